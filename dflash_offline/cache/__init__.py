"""The hidden-state cache as one package: what stage 1 writes and stage 2 reads.

- `fsio`: hashing, atomic writes (temp → fsync → rename), the cache lock, process liveness, dead writers' debris.
- `manifest`: the manifest's schema, open/commit/merge/requeue; the only code that reads `manifest.json`.
- `claims`: leases that split shards between workers, and `sweep` of what dead writers left.
- `encodings`: how a tapped layer's states are stored (bf16, fp8, fp4, …): one `Encoding` per format, in a registry.
- `shards`: token shards (Arrow) and hidden shards (safetensors) on disk, checked reads.
- `writer`: the hidden shard writer that commits shards in the background while the device computes.

Nothing here imports the stages or bench.
"""

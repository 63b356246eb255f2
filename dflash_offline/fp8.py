"""Float8 training of the drafter's linears (`precision=fp8`, through torchao's float8 training).

`convert` swaps the context projection `fc` and every decoder layer's q/k/v/o_proj and gate/up/down_proj for
torchao `Float8Linear`s. Each of their three GEMMs (output, input gradient, weight gradient) casts both operands
to float8 with scales computed from the tensors themselves (torchao's `tensorwise` recipe: dynamic scaling, one
scale per tensor, e4m3 inputs and weights, e5m2 output gradients) and runs `torch._scaled_mm`. Nothing else
changes from a bf16 run: attention (flex/SDPA and its fp32 block part), the norms, RoPE and the residual stream,
the frozen embedding and lm_head (plain tensors that `loss.block_ce_loss` uses functionally, never modules), the
loss, the optimizer and its fp32 master weights. A `Float8Linear` keeps the linear's `.weight` parameter as it was
(fp32, or MasterAdamW's bf16 copy), so state_dict keys, shapes and dtypes are a bf16 run's: checkpoints, resume
and export are unchanged.

`torch._scaled_mm` wants both dimensions of a weight to be multiples of 16; a linear whose are not stays bf16 and
is named in the log. torchao's order: convert before `fully_shard` and before `torch.compile`. `emulate=True`
(tests on the CPU) does the same casts and multiplies the dequantized values in fp32.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable

RECIPE = "tensorwise"  # torchao's float8 scaling (27B linears on an H200: 1.51x bf16; rowwise 1.11x, docs/benchmarks.md)
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later


def check_available(cuda: bool, emulate: bool) -> None:
    """Refuse precision=fp8 where it cannot run, before anything loads: no CUDA (no float8 GEMMs on the CPU), a GPU
    without float8 tensor cores, or no torchao. `emulate` (tests only) lifts the device checks."""
    if not emulate:
        if not cuda:
            raise ValueError("precision=fp8 needs CUDA (float8 GEMMs run on GPUs of compute capability 8.9+, not on "
                             "the CPU); use precision=bf16 or auto")
        check_gpu("precision=fp8", "precision=bf16")
    if importlib.util.find_spec("torchao") is None:
        raise ValueError("precision=fp8 needs torchao: pip install -e '.[fp8]' (make setup installs it)")


def check_gpu(what: str, instead: str) -> None:
    """Refuse `what` on a GPU without float8 tensor cores (the CPU runs float8 GEMMs, slowly: not refused here)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < MIN_CAPABILITY:
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        raise ValueError(f"{what} needs a GPU of compute capability 8.9+ (H100/H200, L40S); this one has {cap}: use "
                         f"{instead}")


def check_token_counts(batch_rows: int, seq_len: int, num_anchors: int, block_size: int) -> None:
    """Refuse micro-batches whose token counts are not multiples of 16: they are the inner dimension of the weight
    gradients' float8 GEMMs (context: rows × seq_len; block: rows × anchors × block_size; the last layer's MLP, which
    skips slot 0: rows × anchors × (block_size − 1)). With num_anchors × batch_rows a multiple of 16 all fit."""
    counts = {"batch_rows × seq_len": batch_rows * seq_len,
              "batch_rows × num_anchors × block_size": batch_rows * num_anchors * block_size,
              "batch_rows × num_anchors × (block_size − 1)": batch_rows * num_anchors * (block_size - 1)}
    bad = [f"{name} = {n}" for name, n in counts.items() if n % 16]
    if bad:
        raise ValueError(f"precision=fp8 needs token counts that are multiples of 16 (float8 GEMMs), got "
                         f"{', '.join(bad)}: make num_anchors × batch_rows a multiple of 16 (and seq_len one)")


def candidates(model) -> list[str]:
    """The module names float8 may take: fc, then each decoder layer's linears."""
    return ["fc"] + [f"layers.{i}.{name}" for i in range(len(model.layers)) for name in LAYER_LINEARS]


def fits(linear) -> bool:
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def convert(model, emulate: bool = False, log: Callable[[str], None] | None = None) -> list[str]:
    """Swap `model`'s fc and decoder-layer linears for float8 ones in place (see the module doc); returns the names
    converted. Call it before sharding and compiling the model."""
    from torchao.float8 import (  # (its import notes: dflash_offline)
        Float8LinearConfig,
        convert_to_float8_training,
    )
    modules = dict(model.named_modules())
    names = [n for n in candidates(model) if fits(modules[n])]
    skipped = [n for n in candidates(model) if not fits(modules[n])]
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(RECIPE), emulate=emulate)
    chosen = set(names)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)
    if log is not None:
        log(f"fp8 ({RECIPE}{', emulated' if emulate else ''}): {len(names)} of {len(names) + len(skipped)} linears "
            f"in float8 (fc, the layers' q/k/v/o and gate/up/down)"
            + (f"; left in bf16 (dimensions not multiples of 16): {', '.join(skipped)}" if skipped else ""))
    return names

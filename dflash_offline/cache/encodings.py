"""How a tapped layer's hidden states are stored in a hidden shard: one `Encoding` per cache format, in a registry.

An encoding (`quant=` in the config, `producer.quant` in the manifest, `quant` in a shard's header) is a frozen
dataclass: the tensors it stores per tapped layer (`tensors`: name → dtype and width as a function of the layer's
width H, stored as `{name}.L{id}` of shape [rows, seq_len, width]), `encode` ([..., H] → those tensors, on any device),
`decode` (those tensors → [..., H] in a dtype, on their device), the widths it can store (`align`), the relative error
per row `make verify` holds it to (`rel_tol`, its round-trip bound) and whether its stored tensor is the state itself
(`direct`: the trainer moves it to the device as it is). Bytes per token follow from `tensors`.

Everything that writes, sizes, verifies or reads a cache asks the registry (`ENCODINGS`, `get`): a new encoding is one
`register(Encoding(...))` — here, or in a test — and no other module changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1 magnitude
FP4_BLOCK = 16  # values per e4m3 block scale (along H)
FP4_ALIGN = 32  # quant=fp4 needs H % 32 == 0 (whole blocks, whole bytes)
FP4_TOKEN_STEP = float(torch.tensor(1 / (FP4_MAX * FP8_MAX), dtype=torch.float32))  # token scale = amax · this
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of e2m1 codes 0..7; code bit 3 is the sign
# round to nearest e2m1, ties to the even code (as the hardware's cvt.rn does): between codes i and i+1 the midpoint
# goes down when i is even (`>`), up when i is odd (`>=`)
E2M1_UP_GT, E2M1_UP_GE = (0.25, 1.25, 2.5, 5.0), (0.75, 1.75, 3.5)


@dataclass(frozen=True)
class Encoding:
    name: str  # the `quant` value that names it
    what: str  # what it stores, one line (the storage plan's table)
    tensors: dict  # name → (torch dtype, width(H) → int): what it stores per tapped layer
    encode: Callable  # [..., H] states → {name: tensor} (any device)
    decode: Callable  # ({name: tensor}, dtype) → [..., H] states in dtype, on the tensors' device
    rel_tol: float  # the least relative error per row `make verify` allows (0: the checked tolerance alone)
    align: int = 1  # H must be a multiple of this
    align_why: str = ""  # why, for the refusal ("stores blocks of 16 values, two a byte")
    direct: bool = False  # its one tensor, `hidden`, is the state in bfloat16: moved to the device as it is

    def size(self, k: int, h: int) -> int:
        """Stored bytes per token of `k` taps of width `h` (unchecked: `bytes_per_token` refuses a width it cannot
        store)."""
        return k * sum(dtype.itemsize * width(h) for dtype, width in self.tensors.values())

    def check_width(self, h: int) -> None:
        if h % self.align:
            other = " or ".join(f"quant={n}" for n in reversed(ENCODINGS) if n != self.name and not h % ENCODINGS[n].align)
            raise ValueError(f"quant={self.name} {self.align_why}: it needs a hidden size that is a multiple of "
                             f"{self.align}, got hidden_size={h}; use {other}")

    def to_device(self, host: dict[str, torch.Tensor], h: int, device, non_blocking: bool) -> torch.Tensor:
        """The stored tensors of a batch, [B, S, k, width] each on the host, → bfloat16 states [B, S, k, h] on
        `device`, decoded there one layer at a time (the float32 temporaries stay one layer big)."""
        if self.direct:
            return host["hidden"].to(device, non_blocking=non_blocking)
        stored = {name: host[name].to(device, non_blocking=non_blocking) for name in self.tensors}
        B, S, k, _ = next(iter(stored.values())).shape
        out_BSkH = torch.empty((B, S, k, h), dtype=torch.bfloat16, device=device)
        for j in range(k):
            out_BSkH[:, :, j] = self.decode({name: t[:, :, j] for name, t in stored.items()}, torch.bfloat16)
        return out_BSkH


ENCODINGS: dict[str, Encoding] = {}  # quant → its encoding, in the order the storage plan lists them


def register(enc: Encoding) -> Encoding:
    if enc.name in ENCODINGS:
        raise ValueError(f"encoding {enc.name!r} is already registered")
    ENCODINGS[enc.name] = enc
    return enc


def get(quant: str) -> Encoding:
    if quant not in ENCODINGS:
        raise ValueError(f"quantization {quant!r} is not one of {', '.join(ENCODINGS)}")
    return ENCODINGS[quant]


def bytes_per_token(quant: str, k: int, hidden: int) -> int:
    """Stored bytes per token of `k` taps in encoding `quant`; refuses a hidden size it cannot store."""
    enc = get(quant)
    enc.check_width(hidden)
    return enc.size(k, hidden)


def encode_layer(x: torch.Tensor, lid: int, quant: str) -> dict[str, torch.Tensor]:
    """One layer's [R, S, H] states → the tensors stored for it, `{name}.L{lid}` (works on any device)."""
    return {f"{name}.L{lid}": t for name, t in get(quant).encode(x).items()}


def decode_layer(parts: dict[str, torch.Tensor], quant: str, dtype=torch.bfloat16) -> torch.Tensor:
    """One layer's stored tensors (by name, without the layer suffix) → [..., H] in `dtype`, on their device."""
    return get(quant).decode(parts, dtype)


# --- fp8 and fp4 -----------------------------------------------------------------------------------------------


def fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H] → (float8_e4m3fn [..., H], float32 scale [..., 1]) with one scale per token (per layer)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def fp8_decode(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


def fp4_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., H] → (uint8 [..., H/2] e2m1 codes, float8_e4m3fn [..., H/16] block scales, float32 [..., 1] token
    scale), on x's device.

    Token scale = amax · fl32(1 / (6 · 448)), so that block scales span e4m3's range; block scale = block amax / 6 / token
    scale = 448 · block amax / token amax, rounded to the nearest e4m3 (a block whose scale rounds down saturates its
    largest values at ±6, by at most 1/16 of them — less than e2m1's own rounding there — while the scale is a normal
    e4m3, i.e. the block's amax is at least 2⁻⁶/448 ≈ 3.5e-5 of the token's; further below, the scale is subnormal,
    with fewer bits, and saturation grows); codes = x / (block scale · token scale) rounded to the nearest e2m1, ties
    to even. A block whose scale underflows e4m3 (all-zero blocks and tokens included) stores zeros. Value 2i of a
    token is the low nibble of its byte i, value 2i + 1 the high nibble."""
    *lead, H = x.shape
    ENCODINGS["fp4"].check_width(H)
    x_NBb = x.float().reshape(*lead, H // FP4_BLOCK, FP4_BLOCK)  # N… leading dims, B blocks, b = 16 values
    # (only correctly rounded tensor ops, no division by a Python number, which CUDA turns into a multiplication by
    # its rounded reciprocal: the same bytes on every device)
    scale_N1 = x_NBb.abs().amax(dim=(-2, -1)).clamp_min(1e-12).unsqueeze(-1) * FP4_TOKEN_STEP
    bscale_NB = (x_NBb.abs().amax(dim=-1) / (scale_N1 * FP4_MAX)).clamp_max(FP8_MAX).to(torch.float8_e4m3fn)
    step_NB = bscale_NB.float() * scale_N1
    a_NBb = torch.where(step_NB.unsqueeze(-1) > 0, x_NBb / step_NB.clamp_min(1e-38).unsqueeze(-1), 0.0)
    mag_NBb = a_NBb.abs()
    code_NBb = torch.zeros(mag_NBb.shape, dtype=torch.uint8, device=x.device)
    for t in E2M1_UP_GT:  # (7 thresholds: a code is the count of those its magnitude passes; 6 and above → 7)
        code_NBb += mag_NBb > t
    for t in E2M1_UP_GE:
        code_NBb += mag_NBb >= t
    code_NBb |= (a_NBb < 0).to(torch.uint8) << 3
    pair_Nh2 = code_NBb.reshape(*lead, H // 2, 2)
    return pair_Nh2[..., 0] | (pair_Nh2[..., 1] << 4), bscale_NB, scale_N1


@functools.cache
def e2m1_table(device: torch.device) -> torch.Tensor:
    """float32 [16]: the value of each e2m1 code, on `device` (made once: no host copy per decode)."""
    return torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=device)


def fp4_decode(packed: torch.Tensor, bscale: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """`fp4_encode`'s (uint8 [..., H/2], e4m3 [..., H/16], float32 [..., 1]) → [..., H] in `dtype`, on their device:
    code value × block scale × token scale."""
    *lead, half = packed.shape
    code_Nh2 = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    v_NBb = e2m1_table(packed.device)[code_Nh2.int()].view(*lead, 2 * half // FP4_BLOCK, FP4_BLOCK)
    step_NB = bscale.float() * scale.float()
    return (v_NBb * step_NB.unsqueeze(-1)).view(*lead, 2 * half).to(dtype)


# --- the registry ----------------------------------------------------------------------------------------------

FP8_REL_TOL = 0.06  # e4m3 keeps 3 mantissa bits: per-element rounding ≤ 6.25 %, RMS ≈ 2–3 %
# e2m1 keeps 1 mantissa bit (a step of 2 between 4 and 6 of a block's 6): RMS relative error per row ≈ 9.5 % on
# Gaussian states, 10 % on uniform, 9 % on Student-t(3), 5 % with massive channels (tests/test_fp4_cache.py), 9.5-9.8 %
# on the tiny target's; single tokens of width 64 reach 14 % in 1 of 10^5. 0.15 is that worst with a margin, above a
# bf16 recompute's noise (≤ 2 %, added in quadrature). A row altered by less than ~10 % hides in FP4's own rounding.
FP4_REL_TOL = 0.15

register(Encoding("bf16", "bfloat16 values", {"hidden": (torch.bfloat16, lambda h: h)},
                  encode=lambda x: {"hidden": x.to(torch.bfloat16)}, decode=lambda p, dtype: p["hidden"].to(dtype),
                  rel_tol=0.0, direct=True))
register(Encoding("fp8", "float8 e4m3 values + a float32 scale per token and layer",
                  {"hidden": (torch.float8_e4m3fn, lambda h: h), "scale": (torch.float32, lambda h: 1)},
                  encode=lambda x: dict(zip(("hidden", "scale"), fp8_encode(x), strict=True)),
                  decode=lambda p, dtype: fp8_decode(p["hidden"], p["scale"], dtype), rel_tol=FP8_REL_TOL))
register(Encoding("fp4", "4-bit e2m1 values + an e4m3 scale per 16 values + a float32 scale per token and layer",
                  {"hidden": (torch.uint8, lambda h: h // 2), "bscale": (torch.float8_e4m3fn, lambda h: h // FP4_BLOCK),
                   "scale": (torch.float32, lambda h: 1)},
                  encode=lambda x: dict(zip(("hidden", "bscale", "scale"), fp4_encode(x), strict=True)),
                  decode=lambda p, dtype: fp4_decode(p["hidden"], p["bscale"], p["scale"], dtype),
                  rel_tol=FP4_REL_TOL, align=FP4_ALIGN, align_why=f"stores blocks of {FP4_BLOCK} values, two a byte"))

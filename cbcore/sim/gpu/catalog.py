"""What the measured tables describe: GPUs, models and interconnects, and the profile names for them.

A profile is named ``GPU-MODEL-tpN`` (``a100-llama-2-70b-tp4``; ``-tpN``
may be left out for TP 1) or given as ``vidur:gpu=a100,model=llama-2-70b,tp=4``
with two more options: ``network=dgx`` (default) or ``network=pairwise-nvlink``,
and ``util=0.9``, the share of GPU memory the engine may use (weights plus
KV cache, as vLLM's ``gpu_memory_utilization``). What the tables do not
cover is refused by name: a model the GPU was not measured with, a degree
the table lacks, A40 at TP > 1 (no all-reduce table) and pairwise NVLink at
8 workers.

The GPU numbers: memory as CUDA reports it, in GiB (Vidur uses the same:
A100-SXM4-80GB and H100-SXM5 80, A40 45 of its 48 GB with ECC on); dense
FP16 tensor-core FLOP/s and memory bandwidth from the data sheets. The
bandwidth attention streams K/V at is not the data sheet's but what the
tables themselves show memory-bound kernels reach: the four linear products
of one Llama-2-70B layer at TP 1 and one token read their weights at
1.60 TB/s on the A100 (78 %), 0.54 TB/s on the A40 (77 %) and 2.89 TB/s on
the H100 (86 %); ``tests/test_gpu_profiles.py`` recomputes these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from cbcore.sim.model_shape import ModelShape

GIB = 2**30
DEFAULT_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization; Vidur's memory margin is 0.1 too
DTYPE_BYTES = 2  # Vidur timed every operator in float16


class CatalogError(ValueError):
    """A profile name or option the tables cannot back; the message says what they do cover."""


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory_gib: float
    peak_flops: float  # dense FP16 tensor-core FLOP/s
    mem_bandwidth: float  # bytes/s, data sheet
    achieved_bandwidth: float  # share of mem_bandwidth that memory-bound kernels reach in the tables
    host_bandwidth: float  # bytes/s to host memory, for swap preemption
    clusters: dict[str, str]  # network option -> all-reduce table


GPUS = {
    "a100": GPU("a100", "NVIDIA A100-SXM4-80GB", 80, 312e12, 2.039e12, 0.78, 25e9,
                {"dgx": "a100_dgx", "pairwise-nvlink": "a100_pairwise_nvlink"}),
    "a40": GPU("a40", "NVIDIA A40", 45, 149.7e12, 696e9, 0.77, 25e9, {}),
    "h100": GPU("h100", "NVIDIA H100-SXM5-80GB", 80, 989e12, 3.35e12, 0.86, 50e9,
                {"dgx": "h100_dgx", "pairwise-nvlink": "h100_pairwise_nvlink"}),
}  # fmt: skip


@dataclass(frozen=True)
class Model:
    key: str
    hf_id: str
    shape: ModelShape
    bias: Literal["none", "qkv", "all"] = "none"
    norm: Literal["rms", "layer"] = "rms"
    norms_per_layer: int = 2  # phi-2 runs attention and MLP side by side after one norm

    def params_per_gpu(self, tp: int) -> int:
        """Weights one GPU holds at tensor-parallel degree ``tp`` (Megatron-style split, vocab-parallel
        embedding and LM head; K/V heads replicated when there are fewer than ``tp``)."""
        s = self.shape
        heads, kv_heads = s.num_heads // tp, math.ceil(s.num_kv_heads / tp)
        qkv_out = (heads + 2 * kv_heads) * s.head_dim
        mlp_out = (2 if s.gated_mlp else 1) * s.intermediate_size // tp
        layer = s.hidden_size * qkv_out + heads * s.head_dim * s.hidden_size + mlp_out * s.hidden_size
        layer += s.intermediate_size // tp * s.hidden_size
        norm = s.hidden_size * (2 if self.norm == "layer" else 1)
        layer += self.norms_per_layer * norm
        if self.bias in ("qkv", "all"):
            layer += qkv_out
        if self.bias == "all":
            layer += s.hidden_size + s.intermediate_size // tp + s.hidden_size
        vocab = s.vocab_size // tp
        head = vocab * s.hidden_size + (vocab if self.bias == "all" else 0)
        return s.num_layers * layer + vocab * s.hidden_size + head + norm


def _shape(name: str, layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int, ctx: int,
           head_dim: int = 128, gated: bool = True) -> ModelShape:  # fmt: skip
    return ModelShape(
        name=name, num_layers=layers, hidden_size=hidden, intermediate_size=inter, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, vocab_size=vocab, gated_mlp=gated, max_position_embeddings=ctx,
    )  # fmt: skip


# Shapes from each model's HF config (vocab as configured, not Vidur's padding to 32,768).
MODELS = {m.key: m for m in (
    Model("llama-2-7b", "meta-llama/Llama-2-7b-hf", _shape("Llama-2-7B", 32, 4096, 11008, 32, 32, 32000, 4096)),
    Model("llama-2-70b", "meta-llama/Llama-2-70b-hf", _shape("Llama-2-70B", 80, 8192, 28672, 64, 8, 32000, 4096)),
    Model("llama-3-8b", "meta-llama/Meta-Llama-3-8B", _shape("Llama-3-8B", 32, 4096, 14336, 32, 8, 128256, 8192)),
    Model("llama-3-70b", "meta-llama/Meta-Llama-3-70B",
          _shape("Llama-3-70B", 80, 8192, 28672, 64, 8, 128256, 8192)),
    Model("codellama-34b", "codellama/CodeLlama-34b-Instruct-hf",
          _shape("CodeLlama-34B", 48, 8192, 22016, 64, 8, 32000, 16384)),
    Model("internlm-20b", "internlm/internlm-20b", _shape("InternLM-20B", 60, 5120, 13824, 40, 40, 103168, 4096)),
    Model("qwen-72b", "Qwen/Qwen-72B", _shape("Qwen-72B", 80, 8192, 24576, 64, 64, 152064, 32768), bias="qkv"),
    Model("phi-2", "microsoft/phi-2", _shape("phi-2", 32, 2560, 10240, 32, 32, 51200, 2048, head_dim=80, gated=False),
          bias="all", norm="layer", norms_per_layer=1),
)}  # fmt: skip


_LLAMA_2 = ("codellama-34b", "internlm-20b", "llama-2-70b", "llama-2-7b", "qwen-72b")
#: (gpu, model) -> the tensor-parallel degrees its table has (what the shipped data holds; a test
#: compares the two). Kept here so naming and refusing profiles reads no data.
MEASURED: dict[tuple[str, str], tuple[int, ...]] = {
    **{(gpu, m): (1, 2, 4, 8) for gpu in GPUS for m in _LLAMA_2},
    **{("a100", m): (1, 2, 4, 8) for m in ("llama-3-8b", "llama-3-70b")},
    **{(gpu, "phi-2"): (1,) for gpu in GPUS},
}
#: all-reduce table -> the worker counts measured inside one node.
NETWORK_WORKERS = {"a100_dgx": (2, 4, 8), "a100_pairwise_nvlink": (2, 4), "h100_dgx": (2, 4, 8),
                   "h100_pairwise_nvlink": (2, 4)}  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """One measured profile: which table, which interconnect, how much memory the engine may use."""

    gpu: str
    model: str
    tp: int = 1
    network: Literal["dgx", "pairwise-nvlink"] = "dgx"
    util: float = DEFAULT_UTILIZATION

    @property
    def name(self) -> str:
        base = f"{self.gpu}-{self.model}-tp{self.tp}"
        if self.network != "dgx" or self.util != DEFAULT_UTILIZATION:
            return f"vidur:gpu={self.gpu},model={self.model},tp={self.tp},network={self.network},util={self.util:g}"
        return base

    @property
    def cluster(self) -> str | None:
        """The all-reduce table (None at TP 1, where nothing is reduced)."""
        return GPUS[self.gpu].clusters[self.network] if self.tp > 1 else None


def validate(spec: Spec) -> Spec:
    from cbcore.plugins import did_you_mean

    if spec.gpu not in GPUS:
        raise CatalogError(f"gpu {spec.gpu!r}: no measured tables{did_you_mean(spec.gpu, list(GPUS))}; "
                           f"measured: {', '.join(GPUS)}")  # fmt: skip
    if spec.model not in MODELS:
        raise CatalogError(f"model {spec.model!r}: no measured tables{did_you_mean(spec.model, list(MODELS))}; "
                           f"measured: {', '.join(MODELS)}")  # fmt: skip
    degrees = MEASURED.get((spec.gpu, spec.model))
    if degrees is None:
        on = sorted(g for g, m in MEASURED if m == spec.model)
        raise CatalogError(f"{spec.model} was not measured on {spec.gpu} (Vidur measured it on {', '.join(on)} only)")
    if spec.tp not in degrees:
        raise CatalogError(f"{spec.gpu} {spec.model}: measured at TP {', '.join(map(str, degrees))} only, not {spec.tp}")
    if not 0 < spec.util <= 1:
        raise CatalogError(f"util={spec.util}: the share of GPU memory must be in (0, 1]")
    if spec.tp > 1:
        gpu = GPUS[spec.gpu]
        if not gpu.clusters:
            raise CatalogError(
                f"{spec.gpu} at TP {spec.tp}: Vidur's tables have no all-reduce measurement for the {spec.gpu.upper()} "
                "(send/recv only), so tensor parallelism cannot be priced; use tp=1, or a100/h100 for TP > 1"
            )
        if spec.network not in gpu.clusters:
            raise CatalogError(f"network={spec.network}: {spec.gpu} has {', '.join(gpu.clusters)}")
        workers = NETWORK_WORKERS[gpu.clusters[spec.network]]
        if spec.tp not in workers:
            raise CatalogError(
                f"{spec.gpu} network={spec.network}: all-reduce measured for {', '.join(map(str, workers))} "
                f"workers only, not {spec.tp} (network=dgx has 2, 4 and 8)"
            )
    return spec


def parse(name: str) -> Spec | None:
    """The spec a profile name stands for; None when ``name`` is not a measured profile's name."""
    if name.startswith("vidur:"):
        options: dict[str, str] = {}
        for item in filter(None, name[len("vidur:"):].split(",")):
            key, sep, value = item.partition("=")
            if not sep or key not in ("gpu", "model", "tp", "network", "util"):
                raise CatalogError(f"{name}: {item!r} is not one of gpu=, model=, tp=, network=, util=")
            options[key] = value
        missing = [k for k in ("gpu", "model") if k not in options]
        if missing:
            raise CatalogError(f"{name}: {' and '.join(missing)} missing (e.g. vidur:gpu=a100,model=llama-2-7b,tp=1)")
        try:
            tp, util = int(options.get("tp", 1)), float(options.get("util", DEFAULT_UTILIZATION))
        except ValueError:
            raise CatalogError(f"{name}: tp must be an integer and util a number") from None
        network = options.get("network", "dgx")
        if network not in ("dgx", "pairwise-nvlink"):
            raise CatalogError(f"{name}: network={network}; known: dgx, pairwise-nvlink")
        return validate(Spec(options["gpu"], options["model"], tp, network, util))  # type: ignore[arg-type]
    gpu, sep, rest = name.partition("-")
    if not sep or gpu not in GPUS:
        return None
    model, tp = rest, 1
    head, sep, degree = rest.rpartition("-tp")
    if sep and degree.isdigit():
        model, tp = head, int(degree)
    return validate(Spec(gpu, model, tp))  # a known GPU's prefix: a measured profile, or a named refusal


def all_specs() -> list[Spec]:
    """Every measured profile with the default interconnect (A40 at TP > 1 left out: it is refused)."""
    return [
        Spec(gpu, model, tp)
        for (gpu, model), degrees in sorted(MEASURED.items())
        for tp in degrees
        if tp == 1 or GPUS[gpu].clusters
    ]


def summary() -> list[str]:
    """One line per GPU x model: the names, for help texts."""
    lines = []
    for (gpu, model), degrees in sorted(MEASURED.items()):
        usable = [tp for tp in degrees if tp == 1 or GPUS[gpu].clusters]
        tps = f"tp{usable[0]}" if len(usable) == 1 else "tp{" + ",".join(map(str, usable)) + "}"
        lines.append(f"{gpu}-{model}-{tps}")
    return lines

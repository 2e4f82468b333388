#!/usr/bin/env bash
# Attention backends on a CUDA machine, in under five minutes:
#   1. what this machine offers (GPU, torch, flash_attn, each backend's availability);
#   2. the CUDA tests of sdpa and flash-varlen (kernels against eager, engine runs
#      against HF generate: float32 token-exact for sdpa, bf16 top-5 for flash-varlen);
#   3. one attention step per backend on the same packed batch (pytest-benchmark);
#   4. engine throughput per backend on a mid-size random Llama in bfloat16;
#   5. vLLM (the official GPU build) with cbcore_vllm.Scheduler under vLLM's default async scheduling:
#      contrib vtc deciding, every request served, greedy tokens against vLLM alone, and the
#      throughput of both (docs/vllm.md: until this section has run, "async end to end: not verified").
# Usage: scripts/gpu_check.sh   (from anywhere; uses .venv/bin/python when present)
#   VLLM_PY=/path/to/python   a Python with vllm (a tested version), cbcore, contrib/vtc and contrib/vllm
#                             installed (pip install --no-deps -e . -e contrib/vtc -e contrib/vllm);
#                             section 5 is skipped without it.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
status=0
section() { printf '\n===== %s =====\n' "$*"; }
run() {  # run <seconds> <command...>: report, never abort the remaining sections
  local limit=$1; shift
  echo "+ $*"
  timeout "$limit" "$@"
  local rc=$?
  [ $rc -eq 124 ] && echo "!! timed out after ${limit}s"
  [ $rc -ne 0 ] && status=1
  return 0
}

section "1/5 environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv
if ! "$PY" -c "import cbcore.backends" 2>/dev/null; then
  echo "cbcore is not importable by $PY; installing it in editable mode (no dependencies)"
  "$PY" -m pip install --no-deps --no-build-isolation -q -e . || { echo "!! cannot install cbcore"; exit 1; }
fi
"$PY" - <<'EOF' || exit 1
import importlib.util
import torch
from cbcore.plugins import get_registry

print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    raise SystemExit("!! no CUDA device visible to torch: nothing to check here")
print(f"device: {torch.cuda.get_device_name()} (sm {'.'.join(map(str, torch.cuda.get_device_capability()))})")
print(f"flash_attn installed: {importlib.util.find_spec('flash_attn') is not None}")
for name in ("pytest", "pytest_benchmark", "hypothesis", "transformers"):
    print(f"{name}: {'yes' if importlib.util.find_spec(name) else 'MISSING'}")
cuda = torch.device("cuda")
for entry in sorted(get_registry().entries("backend"), key=lambda e: e.name):
    reason = entry.cls.unavailable_reason(cuda)
    print(f"backend {entry.name:<14} {'available' if reason is None else 'unavailable: ' + reason}")
EOF

section "2/5 CUDA tests: sdpa and flash-varlen against eager and HF generate"
run 240 "$PY" -m pytest -m cuda -q -rs -o addopts="" -p no:cacheprovider \
  tests/test_backend_sdpa.py tests/test_backend_flash_varlen.py

section "3/5 one attention step per backend, same packed batch (bf16, 8 layers)"
run 90 env CB_BENCH_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -o addopts="" --benchmark-enable \
  --benchmark-max-time=0.5 --benchmark-columns=median,iqr,rounds tests/benchmarks/test_bench_backends.py

section "4/5 engine throughput per backend (random Llama, bf16, 64 requests)"
run 120 "$PY" - <<'EOF'
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from cbcore import Engine, EngineConfig, SamplingParams
from cbcore.plugins import get_registry

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 32000, (int(n),), generator=gen).tolist() for n in torch.randint(64, 512, (64,), generator=gen)]
params = SamplingParams(max_new_tokens=128, ignore_eos=True)
cuda = torch.device("cuda")
results = {}
for entry in sorted(get_registry().entries("backend"), key=lambda e: e.name):
    if entry.cls.unavailable_reason(cuda) is not None:
        continue
    cfg = EngineConfig.model_validate({
        "backend": {"name": entry.name},
        "kv_cache": {"block_size": 256, "num_blocks": 256},
        "scheduler": {"budget": {"name": "token-budget", "max_num_seqs": 64, "max_num_batched_tokens": 2048}},
    })
    engine = Engine(model, config=cfg)
    engine.generate(prompts[:4], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    warm_steps = len(engine.step_stats)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.output_token_ids) for o in outputs)
    results[entry.name] = tokens / seconds
    steps = engine.step_stats[warm_steps:]
    forward = sum(s.forward_s for s in steps)
    print(f"{entry.name:<14} {tokens} tokens in {seconds:6.2f} s = {tokens / seconds:8.1f} tok/s "
          f"(forward {forward:5.2f} s over {len(steps)} steps)")
base = results.get("eager")
if base:
    print("throughput relative to eager: " + ", ".join(f"{k} {v / base:.2f}x" for k, v in results.items()))
EOF

section "5/5 vLLM with cbcore_vllm.Scheduler, async scheduling (vLLM's GPU build)"
if [ -z "${VLLM_PY:-}" ] || ! "$VLLM_PY" -c "import vllm, cbcore_vllm, cbcore_vtc" 2>/dev/null; then
  echo "skipped: set VLLM_PY to a Python with vllm, cbcore, cbcore-vtc and cbcore-vllm installed"
else
  run 600 env VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VLLM_PY" - <<'EOF'
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from vllm import LLM, SamplingParams

torch.manual_seed(0)
path = tempfile.mkdtemp()
config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
gen = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(3, 32000, (int(n),), generator=gen).tolist()}
           for n in torch.randint(64, 512, (128,), generator=gen)]
params = [SamplingParams(max_tokens=128, temperature=0, ignore_eos=True, extra_args={"client_id": f"tenant-{i % 3}"})
          for i in range(len(prompts))]
cbcore = {"scheduler": {"queue": {"name": "vtc"},
                        "budget": {"name": "token-budget", "max_num_seqs": 64, "max_num_batched_tokens": 2048}}}
runs = {}
for name, extra in (("vLLM alone", {}),
                    ("vLLM + cbcore_vllm (vtc)", {"scheduler_cls": "cbcore_vllm.Scheduler",
                                                  "additional_config": {"cbcore": cbcore}})):
    llm = LLM(model=path, dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048, seed=0, **extra)
    sc = llm.llm_engine.vllm_config.scheduler_config
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    reasons = {o.outputs[0].finish_reason for o in outs}
    runs[name] = [list(o.outputs[0].token_ids) for o in outs]
    print(f"{name:<26} async_scheduling={sc.async_scheduling} scheduler={sc.get_scheduler_cls().__name__}: "
          f"{tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s, finish reasons {sorted(reasons)}")
    assert sc.async_scheduling, "vLLM turned async scheduling off"
    assert reasons == {"length"} and tokens == 128 * len(prompts)
    del llm
    torch.cuda.empty_cache()
same = sum(a == b for a, b in zip(*runs.values()))
print(f"greedy tokens equal to vLLM alone for {same} of {len(prompts)} requests (vtc changes only the order)")
EOF
fi

section "done"
[ $status -eq 0 ] && echo "all sections passed" || echo "!! some section failed (see above)"
exit $status

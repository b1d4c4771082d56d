#!/usr/bin/env bash
# Check a GPU machine end to end: one PASS/FAIL line per step, in under 10 minutes.
#
#   bash bench/gpu_smoke.sh [OUT_DIR]          # default OUT_DIR: gpu-smoke/
#
# Profiles a GPT on 1 and 2 stages in float32 and bfloat16, solves, runs with a report, a
# checkpoint and --resume, compares the run's gradients with one process on the GPU (rtol 1e-3),
# injects a failing and a killed rank (named right, every process gone within 60 s), tunes, and
# with 2+ GPUs measures the links and runs N stages through torchrun. Everything it makes, the
# profiles first, stays in OUT_DIR; logs/ holds each step's output.
#
# UMOPT_SMOKE_DEVICE=cpu runs the same steps on the CPU (gloo, a smaller GPT, 2 "GPUs"): a check
# of the script itself on a machine without a GPU.
set -u
OUT=${1:-gpu-smoke}
DEVICE=${UMOPT_SMOKE_DEVICE:-cuda}
mkdir -p "$OUT/logs"
PASSED=0
FAILED=0
T_START=$SECONDS

step() {  # step NAME COMMAND...: run it, print PASS or FAIL with the last line it printed
  local name=$1
  shift
  local log="$OUT/logs/${name// /_}.log" t0=$SECONDS
  if "$@" >"$log" 2>&1; then
    PASSED=$((PASSED + 1))
    printf 'PASS  %-44s %4ds\n' "$name" $((SECONDS - t0))
  else
    FAILED=$((FAILED + 1))
    printf 'FAIL  %-44s %4ds  %s\n' "$name" $((SECONDS - t0)) "$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-160)"
  fi
}

no_rank_left() { ! pgrep -f "umopt.runtime" >/dev/null; }

if [ "$DEVICE" = cuda ]; then
  GPUS=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  GPT=(--model gpt --model-arg layers=8 --model-arg d_model=1024 --model-arg heads=16 --model-arg vocab=32768 --model-arg seq_len=512)
  B=64
  MAX=16
else
  GPUS=2
  GPT=(--model gpt --model-arg layers=2 --model-arg d_model=64 --model-arg heads=2 --model-arg vocab=256 --model-arg seq_len=16)
  B=16
  MAX=8
fi
# with one GPU the link between two stages is given (NVLink-like), not measured
LINK=()
[ "$GPUS" -lt 2 ] && LINK=(--link-latency-ms 0.01 --link-gbps 400)
RUN_STAGES=$([ "$GPUS" -ge 2 ] && echo 2 || echo 1)  # a run needs a GPU per stage

env_check() {
  python - "$DEVICE" <<'EOF'
import sys, torch
import umopt
dev = sys.argv[1]
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
if dev == "cuda":
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    print("nccl", torch.cuda.nccl.version(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    import torch.distributed as dist
    assert dist.is_nccl_available(), "this torch has no NCCL"
EOF
}
step "environment ($DEVICE, $GPUS GPUs)" env_check

for dtype in float32 bfloat16; do
  for S in 1 2; do
    extra=()
    [ "$S" -gt 1 ] && extra=("${LINK[@]}")
    step "profile gpt S=$S $dtype" umopt profile "${GPT[@]}" --stages "$S" --max-size "$MAX" --device "$DEVICE" \
      --dtype "$dtype" "${extra[@]}" -o "$OUT/gpt-s$S-$dtype.json"
  done
done

P="$OUT/gpt-s$RUN_STAGES-float32.json"
PB="$OUT/gpt-s$RUN_STAGES-bfloat16.json"
step "solve S=$RUN_STAGES float32" umopt solve "$P" -B "$B" --time-limit 10 -o "$OUT/sched.json" --plot "$OUT/sched.png"
step "solve S=$RUN_STAGES bfloat16" umopt solve "$PB" -B "$B" --time-limit 10 -o "$OUT/sched-bf16.json"
step "run with report and checkpoint" umopt run "$OUT/sched.json" --steps 3 --warmup 1 --report "$OUT/report.json" \
  --plot "$OUT/measured.png" --checkpoint "$OUT/ck"
step "run --resume" umopt run "$OUT/sched.json" --steps 2 --warmup 0 --checkpoint "$OUT/ck" --resume
step "run bfloat16" umopt run "$OUT/sched-bf16.json" --steps 3 --warmup 1 --report "$OUT/report-bf16.json"
step "gradients vs one process (rtol 1e-3)" bash -c "umopt run '$OUT/sched.json' --steps 1 --warmup 0 --save-grads '$OUT/grads' \
  && python bench/grad_check.py '$OUT/sched.json' '$OUT/grads' --rtol 1e-3"
step "gradients vs one process, bfloat16" bash -c "umopt run '$OUT/sched-bf16.json' --steps 1 --warmup 0 --save-grads '$OUT/grads-bf16' \
  && python bench/grad_check.py '$OUT/sched-bf16.json' '$OUT/grads-bf16' --rtol 2e-2"

FAULT_RANK=$((RUN_STAGES - 1))
fault() {  # fault KIND EXPECTED: the run fails naming rank FAULT_RANK, within 60 s, no rank left
  local t0=$SECONDS msg
  msg=$(UMOPT_FAULT="$FAULT_RANK:1:$1" timeout 90 umopt run "$OUT/sched.json" --steps 5 --warmup 0 2>&1 >/dev/null)
  echo "$msg"
  sleep 1
  [[ "$msg" == *"$2"* ]] && [ $((SECONDS - t0)) -le 60 ] && no_rank_left
}
step "fault: raise in rank $FAULT_RANK" fault raise "rank $FAULT_RANK (stage $FAULT_RANK) failed: RuntimeError: injected fault"
step "fault: kill rank $FAULT_RANK" fault kill "rank $FAULT_RANK (stage $FAULT_RANK) ended without a word"

tune_extra=()
[ "$RUN_STAGES" -gt 1 ] && tune_extra=("${LINK[@]}")
step "tune --device $DEVICE" umopt tune "${GPT[@]}" --stages "$RUN_STAGES" --minibatch "$B" --device "$DEVICE" \
  --dtype bfloat16 "${tune_extra[@]}" --steps 4 --rounds 2 --time-limit 10 --out "$OUT/tune"

if [ "$GPUS" -ge 2 ]; then
  N=$([ "$DEVICE" = cuda ] && echo "$GPUS" || echo 2)
  N=$((N > 8 ? 8 : N))
  step "profile gpt S=$N, links measured" umopt profile "${GPT[@]}" --stages "$N" --max-size "$MAX" --device "$DEVICE" \
    --dtype bfloat16 -o "$OUT/gpt-s$N-bfloat16-links.json"
  step "solve S=$N" umopt solve "$OUT/gpt-s$N-bfloat16-links.json" -B "$B" --time-limit 10 -o "$OUT/sched-n.json"
  step "torchrun -m umopt.runtime, $N stages" python -m torch.distributed.run --standalone --nproc-per-node "$N" \
    -m umopt.runtime "$OUT/sched-n.json" --steps 3 --warmup 1 --report "$OUT/report-n.json"
fi

python - "$OUT" <<'EOF' || true
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("report.json", "report-bf16.json", "report-n.json"):
    f = out / name
    if f.exists():
        r = json.loads(f.read_text())
        print(f"{name}: measured {r['measured_iteration_ms']:.2f} ms, predicted {r['predicted_iteration_ms']:.2f}, measured/predicted {r['measured_over_predicted']:.3f}")
for f in sorted((out / "tune").glob("report_*.json")):
    r = json.loads(f.read_text())
    print(f"tune {f.stem[7:]}: measured {r['measured_iteration_ms']:.2f} ms, predicted {r['predicted_iteration_ms']:.2f}")
for f in sorted(out.glob("gpt-s*.json")):
    p = json.loads(f.read_text())
    links = ", ".join(f"{l['latency_ms']:.3f} ms + {8 * l['bytes_per_ms'] / 1e6:.0f} Gbit/s ({l.get('source', '')})" for l in p["links"])
    print(f"{f.name}: {p['device']['name']}, links: {links or 'none'}")
EOF
echo "$PASSED passed, $FAILED failed in $((SECONDS - T_START)) s; profiles and logs in $OUT/"
[ "$FAILED" -eq 0 ]

#!/usr/bin/env bash
# Check a GPU machine end to end, in under 10 minutes: one PASS / FAIL / SKIP line per step, each
# saying what it checked (or why it could not run here), and a last line `N passed, N failed, N skipped`.
#
#   bash bench/gpu_smoke.sh [OUT_DIR]          # default OUT_DIR: gpu-smoke/
#
# What it checks, by the GPUs it finds:
#   1 GPU   profiles (float32, bfloat16; probe runs must not fail), solves, one-stage runs (report
#           with measured/predicted in 0.8-1.25, checkpoint, --resume), gradients against one
#           process, a failing rank, tune; the multi-rank steps SKIP ("needs 2 GPUs").
#   2+ GPUs the same on a 2-stage pipeline through NCCL (links measured, messages, the boundary
#           shapes agreed between ranks), faults in one rank of two (raised before and in the
#           middle of a step, killed: named right, within 60 s, none of its processes left).
#   3+ GPUs a 3-stage pipeline (a middle stage with both links busy): profile, solve, run,
#           gradients.
#   N GPUs  (N > 3, at most 8) N stages, links measured concurrently, run under torchrun.
# Everything it makes, the profiles first, stays in OUT_DIR; logs/ holds each step's output.
#
# UMOPT_SMOKE_DEVICE=cpu runs the same steps on the CPU (gloo, a smaller GPT, a core per "GPU"): a
# check of the script itself on a machine without a GPU.
set -u
OUT=${1:-gpu-smoke}
HERE=$(cd "$(dirname "$0")" && pwd)
DEVICE=${UMOPT_SMOKE_DEVICE:-cuda}
BUDGET_S=${UMOPT_SMOKE_BUDGET_S:-570}  # optional steps are skipped past this, so the whole stays under 10 minutes
mkdir -p "$OUT/logs"
PASSED=0
FAILED=0
SKIPPED=0
T_START=$SECONDS
# every process this script starts inherits the tag: the leftover check looks at those only
export UMOPT_SMOKE_TAG="smoke-$$-$RANDOM"

report() {  # report STATE NAME SECONDS WHAT
  printf '%-4s  %-46s %4ss  %s\n' "$1" "$2" "$3" "$4"
}

skip() {  # skip NAME REASON
  SKIPPED=$((SKIPPED + 1))
  report SKIP "$1" - "$2"
}

step() {  # step NAME WHAT_IT_CHECKS COMMAND...: PASS with what it checked, FAIL with the last line printed
  local name=$1 what=$2
  shift 2
  local log="$OUT/logs/${name//[^A-Za-z0-9=.-]/_}.log" t0=$SECONDS
  if "$@" >"$log" 2>&1 && no_process_left; then
    PASSED=$((PASSED + 1))
    report PASS "$name" $((SECONDS - t0)) "$what"
  else
    FAILED=$((FAILED + 1))
    local why
    why=$(no_process_left || echo "left running: $(ours_left | tr '\n' ' ')")
    [ -z "$why" ] && why=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200)
    report FAIL "$name" $((SECONDS - t0)) "$why"
  fi
}

within_budget() {  # within_budget NAME: false (and a SKIP line) once the time budget is spent
  if [ $((SECONDS - T_START)) -gt "$BUDGET_S" ]; then
    skip "$1" "the ${BUDGET_S} s budget is spent (UMOPT_SMOKE_BUDGET_S)"
    return 1
  fi
}

ours_left() {  # python processes carrying this run's tag, still there
  local pid
  for pid in $(pgrep -f python 2>/dev/null); do
    { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qx "UMOPT_SMOKE_TAG=$UMOPT_SMOKE_TAG" && echo "$pid"
  done
}

no_process_left() {  # a second to exit, then none of ours may be left
  [ -z "$(ours_left)" ] && return 0
  sleep 2
  [ -z "$(ours_left)" ]
}

if [ "$DEVICE" = cuda ]; then
  GPUS=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  GPT=(--model gpt --model-arg layers=8 --model-arg d_model=1024 --model-arg heads=16 --model-arg vocab=32768 --model-arg seq_len=512)
  B=64
  MAX=16
  RTOL=1e-3
else
  GPUS=$(nproc)  # a core per rank
  GPT=(--model gpt --model-arg layers=3 --model-arg d_model=64 --model-arg heads=2 --model-arg vocab=256 --model-arg seq_len=16)
  B=16
  MAX=8
  RTOL=1e-5
fi
UNIT=$([ "$DEVICE" = cuda ] && echo GPUs || echo cores)
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
    import torch.distributed as dist
    assert dist.is_nccl_available(), "this torch has no NCCL"
    print("nccl", torch.cuda.nccl.version(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
}
step "environment ($DEVICE, $GPUS $UNIT)" "torch sees the device$([ "$DEVICE" = cuda ] && echo ', NCCL is there')" env_check

probes_ok() {  # probes_ok PROFILE: the probe runs fitted the profile, or could not run for a stated reason; they never failed
  python - "$1" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
probes = (p.get("meta") or {}).get("probes") or {}
print("probes:", probes.get("ran"), probes.get("why", ""))
assert probes, "the profile says nothing of its probe runs"
assert "failed" not in str(probes.get("why", "")), f"probe runs failed: {probes['why']}"
EOF
}

profile_step() {  # profile_step S DTYPE FILE [extra options]: the profile, then its probes checked
  local S=$1 dtype=$2 file=$3
  shift 3
  umopt profile "${GPT[@]}" --stages "$S" --max-size "$MAX" --device "$DEVICE" --dtype "$dtype" "$@" -o "$file" && probes_ok "$file"
}

ratio_ok() {  # ratio_ok REPORT: measured/predicted within 0.8-1.25
  python - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
ratio = r["measured_over_predicted"]
print(f"measured {r['measured_iteration_ms']:.2f} ms, predicted {r['predicted_iteration_ms']:.2f} ms, measured/predicted {ratio:.3f}")
assert 0.8 <= ratio <= 1.25, f"measured/predicted {ratio:.3f} is outside 0.8-1.25"
EOF
}

run_step() {  # run_step SCHEDULE REPORT [options]: a run, then its measured/predicted checked
  local sched=$1 rep=$2
  shift 2
  umopt run "$sched" --steps 5 --warmup 2 --report "$rep" "$@" && ratio_ok "$rep"
}

grads_step() {  # grads_step SCHEDULE DIR RTOL: one step's gradients against one process
  umopt run "$1" --steps 1 --warmup 0 --save-grads "$2" && python "$HERE/grad_check.py" "$1" "$2" --rtol "$3"
}

for dtype in float32 bfloat16; do
  extra=()
  [ "$RUN_STAGES" -gt 1 ] && extra=("${LINK[@]}")
  links=$([ "$RUN_STAGES" -gt 1 ] && { [ ${#LINK[@]} -gt 0 ] && echo ", link given" || echo ", link measured"; })
  step "profile gpt S=$RUN_STAGES $dtype" "a profile$links; probe runs fitted it or said why not" \
    profile_step "$RUN_STAGES" "$dtype" "$OUT/gpt-s$RUN_STAGES-$dtype.json" "${extra[@]}"
done
if [ "$RUN_STAGES" -lt 2 ]; then  # one GPU: the 2-stage profile can still be made, with the link given
  step "profile gpt S=2 bfloat16, link given" "a 2-stage profile on one GPU; probes said why they could not run" \
    profile_step 2 bfloat16 "$OUT/gpt-s2-bfloat16.json" "${LINK[@]}"
fi

P="$OUT/gpt-s$RUN_STAGES-float32.json"
PB="$OUT/gpt-s$RUN_STAGES-bfloat16.json"
step "solve S=$RUN_STAGES float32" "a valid schedule file and its Gantt chart" \
  umopt solve "$P" -B "$B" --time-limit 10 -o "$OUT/sched.json" --plot "$OUT/sched.png"
step "solve S=$RUN_STAGES bfloat16" "a valid schedule file" umopt solve "$PB" -B "$B" --time-limit 10 -o "$OUT/sched-bf16.json"
VIA=$([ "$RUN_STAGES" -gt 1 ] && echo "$RUN_STAGES ranks through $([ "$DEVICE" = cuda ] && echo NCCL || echo gloo)" || echo "1 rank, no messages")
step "run S=$RUN_STAGES, report and checkpoint" "$VIA; measured/predicted in 0.8-1.25; a checkpoint set" \
  run_step "$OUT/sched.json" "$OUT/report.json" --plot "$OUT/measured.png" --checkpoint "$OUT/ck"
step "run --resume" "the checkpoint set read back and the run continued" \
  umopt run "$OUT/sched.json" --steps 2 --warmup 0 --checkpoint "$OUT/ck" --resume
step "run S=$RUN_STAGES bfloat16" "$VIA under autocast; measured/predicted in 0.8-1.25" run_step "$OUT/sched-bf16.json" "$OUT/report-bf16.json"
step "gradients vs one process (rtol $RTOL)" "$VIA: one step's gradients equal one process's" \
  grads_step "$OUT/sched.json" "$OUT/grads" "$RTOL"
step "gradients vs one process, bfloat16" "the same under autocast (rtol 2e-2)" grads_step "$OUT/sched-bf16.json" "$OUT/grads-bf16" 2e-2

fault() {  # fault KIND EXPECTED: the run fails with EXPECTED in its one line, within 60 s
  local t0=$SECONDS msg
  msg=$(UMOPT_FAULT="$FAULT_RANK:1:$1" timeout 90 umopt run "$OUT/sched.json" --steps 5 --warmup 0 2>&1 >/dev/null)
  echo "$msg"
  [[ "$msg" == *"$2"* ]] || { echo "expected: $2"; return 1; }
  [ $((SECONDS - t0)) -le 60 ] || { echo "took $((SECONDS - t0)) s"; return 1; }
}
FAULT_RANK=$((RUN_STAGES - 1))
step "fault: raise in rank $FAULT_RANK" "the run exits 1 naming rank $FAULT_RANK and its error, within 60 s, nothing left" \
  fault raise "rank $FAULT_RANK (stage $FAULT_RANK) failed: RuntimeError: injected fault"
if [ "$RUN_STAGES" -gt 1 ]; then
  step "fault: raise mid-step in rank $FAULT_RANK" "messages in flight: its error still named, within 60 s, nothing left" \
    fault midstep "rank $FAULT_RANK (stage $FAULT_RANK) failed: RuntimeError: injected fault in the middle"
  step "fault: kill rank $FAULT_RANK" "the killed rank named (SIGKILL), the other stopped, nothing left" \
    fault kill "rank $FAULT_RANK (stage $FAULT_RANK) ended without a word: killed by SIGKILL"
else
  skip "fault: raise mid-step, kill" "a fault among ranks needs 2 $UNIT"
fi

if within_budget "tune --device $DEVICE"; then
  tune_extra=()
  [ "$RUN_STAGES" -gt 1 ] && tune_extra=("${LINK[@]}")
  step "tune --device $DEVICE" "profile, solve, every candidate measured in turns, recommended.json written" \
    umopt tune "${GPT[@]}" --stages "$RUN_STAGES" --minibatch "$B" --device "$DEVICE" \
    --dtype bfloat16 "${tune_extra[@]}" --steps 4 --rounds 2 --time-limit 10 --out "$OUT/tune"
fi

if [ "$GPUS" -lt 3 ]; then
  skip "3-stage pipeline" "needs 3 $UNIT (a middle stage with both links busy)"
elif within_budget "3-stage pipeline"; then
  step "profile gpt S=3 bfloat16" "links measured between the stages' $UNIT; probes fitted it" profile_step 3 bfloat16 "$OUT/gpt-s3-bfloat16.json"
  step "solve S=3" "a valid schedule file" umopt solve "$OUT/gpt-s3-bfloat16.json" -B "$B" --time-limit 10 -o "$OUT/sched-3.json"
  step "run S=3" "3 ranks, the middle one on two links; measured/predicted in 0.8-1.25" run_step "$OUT/sched-3.json" "$OUT/report-3.json"
  step "gradients S=3 (rtol 2e-2)" "one step's gradients equal one process's" grads_step "$OUT/sched-3.json" "$OUT/grads-3" 2e-2
fi

N=$((GPUS > 8 ? 8 : GPUS))
if [ "$DEVICE" != cuda ] || [ "$N" -le 3 ]; then
  skip "torchrun, all GPUs" "needs more than 3 GPUs"
elif within_budget "torchrun, $N stages"; then
  step "profile gpt S=$N, links measured" "$((N - 1)) links, disjoint pairs measured at once" \
    profile_step "$N" bfloat16 "$OUT/gpt-s$N-bfloat16.json"
  step "solve S=$N" "a valid schedule file" umopt solve "$OUT/gpt-s$N-bfloat16.json" -B "$B" --time-limit 10 -o "$OUT/sched-n.json"
  torchrun_n() {
    python -m torch.distributed.run --standalone --nproc-per-node "$N" -m umopt.cli run "$OUT/sched-n.json" \
      --steps 5 --warmup 2 --report "$OUT/report-n.json" && ratio_ok "$OUT/report-n.json"
  }
  step "torchrun -m umopt.cli run, $N stages" "the multi-machine path on one: measured/predicted in 0.8-1.25" torchrun_n
fi

echo
python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for f in sorted(out.glob("report*.json")):
    r = json.loads(f.read_text())
    print(f"{f.name}: measured {r['measured_iteration_ms']:.2f} ms, predicted {r['predicted_iteration_ms']:.2f}, measured/predicted {r['measured_over_predicted']:.3f}")
tune = sorted((out / "tune").glob("report_*.json"))
if tune:
    ms = {f.stem[7:]: json.loads(f.read_text())["measured_iteration_ms"] for f in tune}
    equal = min((v for k, v in ms.items() if "equal" in k), default=None)
    for name, v in sorted(ms.items(), key=lambda kv: kv[1]):
        print(f"tune {name}: measured {v:.2f} ms" + (f", {equal / v:.3f}x the best equal schedule" if equal else ""))
for f in sorted(out.glob("gpt-s*.json")):
    p = json.loads(f.read_text())
    links = ", ".join(f"{l['latency_ms']:.3f} ms + {8 * l['bytes_per_ms'] / 1e6:.0f} Gbit/s ({l.get('source', '')})" for l in p["links"])
    print(f"{f.name}: {p['device']['name']}, links: {links or 'none'}")
EOF
echo "profiles and logs in $OUT/, $((SECONDS - T_START)) s"
echo "$PASSED passed, $FAILED failed, $SKIPPED skipped"
[ "$FAILED" -eq 0 ]

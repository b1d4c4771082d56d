#!/usr/bin/env bash
# Check a GPU machine end to end, within a hard wall-clock budget: one PASS / FAIL / SKIP line per
# step, each saying what it checked (or why it could not run here), and a last line
# `N passed, N failed, N skipped`, printed whatever happens (the budget ends steps, not the script).
#
#   bash bench/gpu_smoke.sh [OUT_DIR]          # default OUT_DIR: gpu-smoke/
#
# UMOPT_SMOKE_BUDGET_S (default 540): seconds for everything; a step gets what is left, and steps
# past the budget are skipped with the reason. UMOPT_SMOKE_RANKS: use fewer GPUs (or cores) than
# there are. UMOPT_SMOKE_DEVICE=cpu runs the same steps on the CPU (gloo, a smaller GPT, a core per
# "GPU"): a check of the script itself on a machine without a GPU.
#
# What it plays, by the GPUs it finds (N = 1..8), most telling first:
#   1+  first, what no GPU has run yet: sequences of different lengths on one GPU (a profile over
#       lengths, a plan, umopt's, padding's and packing's plans in turns, planned ahead beside
#       CUDA; each method's peak memory within 10% of its plans', either way), a packed forward
#       without the host waiting for the GPU, and a transformers Llama planned and trained so;
#       then profile (bfloat16, probes fitted), solve, run (measured/predicted in 0.8-1.25; each
#       rank's peak memory within 10% of the prediction), the schedule file's candidates measured
#       in turns and one kept (2+ stages: one stage has none), gradients against one process,
#       checkpoint and --resume, a failing rank, float32, tune;
#   2+  several chunks per rank, V-shaped (torch's ZBV order: W ops), through `umopt run` and
#       through `umopt.Pipeline` under torchrun, gradients against one process; faults among ranks;
#   3+  a looped schedule on 3 ranks (the deadlock NCCL's lazy connections would find), both ways;
#   4+  --dp 2: two replicas of a 2-rank pipeline, one chunk and V-shaped;
#   2+  sequences of different lengths on 2 ranks (bench/varlen_measured.py --device cuda), before
#       the fault runs;
#   N>3 N stages under torchrun.
# Everything it makes, the profiles first, stays in OUT_DIR; logs/ holds each step's output.
set -u
OUT=${1:-gpu-smoke}
HERE=$(cd "$(dirname "$0")" && pwd)
DEVICE=${UMOPT_SMOKE_DEVICE:-cuda}
BUDGET_S=${UMOPT_SMOKE_BUDGET_S:-540}
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

counts() {
  echo "profiles and logs in $OUT/, $((SECONDS - T_START)) s of a ${BUDGET_S} s budget"
  echo "$PASSED passed, $FAILED failed, $SKIPPED skipped"
}
trap 'echo; echo "interrupted"; counts; exit 130' INT TERM

skip() {  # skip NAME REASON
  SKIPPED=$((SKIPPED + 1))
  report SKIP "$1" - "$2"
}

left() { echo $((BUDGET_S - (SECONDS - T_START))); }

step() {  # step NAME WHAT_IT_CHECKS COMMAND...: PASS with what it checked, FAIL with the last line printed
  local name=$1 what=$2
  shift 2
  local log="$OUT/logs/${name//[^A-Za-z0-9=.-]/_}.log" t0=$SECONDS rest
  rest=$(left)
  if [ "$rest" -lt 15 ]; then
    skip "$name" "the ${BUDGET_S} s budget is spent (UMOPT_SMOKE_BUDGET_S)"
    return 1
  fi
  if within "$rest" "$log" "$@" && no_process_left; then
    PASSED=$((PASSED + 1))
    report PASS "$name" $((SECONDS - t0)) "$what"
    grep -h '^SMOKE: ' "$log" | sed 's/^SMOKE: /        /'
  else
    FAILED=$((FAILED + 1))
    local why
    why=$(no_process_left || echo "left running: $(ours_left | tr '\n' ' ')")
    [ -z "$why" ] && [ $((SECONDS - t0)) -ge "$rest" ] && why="ended by the budget after $((SECONDS - t0)) s"
    [ -z "$why" ] && why=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200)
    report FAIL "$name" $((SECONDS - t0)) "$why"
    return 1
  fi
}

within() {  # within SECONDS LOG COMMAND...: the command (a function too) in a process group of its own, ended with it at the deadline
  local rest=$1 log=$2 pid rc
  shift 2
  set -m
  ("$@") >"$log" 2>&1 &
  pid=$!
  set +m
  local deadline=$((SECONDS + rest))
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      kill -TERM -- -"$pid" 2>/dev/null
      sleep 3
      kill -KILL -- -"$pid" 2>/dev/null
      break
    fi
    sleep 1
  done
  wait "$pid"
  rc=$?
  return "$rc"
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
  LLAMA=(--model hf:llama --model-arg hidden_size=1024 --model-arg num_hidden_layers=8 --model-arg num_attention_heads=16 --model-arg num_key_value_heads=4 --model-arg intermediate_size=2816 --model-arg vocab_size=32768 --model-arg max_position_embeddings=512)
  LONGEST=512
  VL_B=32
else
  # the cores this process may run on (not OMP_NUM_THREADS, which torchrun and users set to 1)
  GPUS=$(python -c "import os; print(len(os.sched_getaffinity(0)))")
  GPT=(--model gpt --model-arg layers=4 --model-arg d_model=64 --model-arg heads=2 --model-arg vocab=256 --model-arg seq_len=16)
  B=16
  MAX=8
  RTOL=1e-5
  LLAMA=(--model hf:llama --model-arg hidden_size=64 --model-arg num_hidden_layers=2 --model-arg num_attention_heads=2 --model-arg num_key_value_heads=1 --model-arg intermediate_size=128 --model-arg vocab_size=256 --model-arg max_position_embeddings=64)
  LONGEST=16
  VL_B=8
fi
GPUS=${UMOPT_SMOKE_RANKS:-$GPUS}
UNIT=$([ "$DEVICE" = cuda ] && echo GPUs || echo cores)
BACKEND=$([ "$DEVICE" = cuda ] && echo nccl || echo gloo)
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

layered_step() {  # layered_step S FILE: a profile layer by layer with the backward split (no probes)
  umopt profile "${GPT[@]}" --stages "$1" --max-size "$MAX" --device "$DEVICE" --dtype bfloat16 \
    --chunks 2 --split-backward --no-probes -o "$2"
}

report_ok() {  # report_ok REPORT [ratio|noratio]: measured/predicted in 0.8-1.25, each rank's peak memory within 10% either way (GPUs)
  python - "$1" "${2:-ratio}" "$DEVICE" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
ratio = r["measured_over_predicted"]
print(f"SMOKE: measured {r['measured_iteration_ms']:.2f} ms, predicted {r['predicted_iteration_ms']:.2f} ms, measured/predicted {ratio:.3f}")
mem = r.get("peak_memory_bytes") or {}
bad = []
for k, (m, p) in enumerate(zip(mem.get("measured") or [], mem.get("predicted") or [])):
    print(f"SMOKE: rank {k} peak memory {m / 2**20:.1f} MiB measured, {p / 2**20:.1f} MiB predicted ({m / p:.3f})")
    if sys.argv[3] == "cuda" and not 0.90 * p <= m <= 1.10 * p:  # either way: far over is as wrong as under
        bad.append(f"rank {k} allocated {m / p:.2f}x its predicted peak")
if sys.argv[2] == "ratio":
    assert 0.8 <= ratio <= 1.25, f"measured/predicted {ratio:.3f} is outside 0.8-1.25"
assert not bad, "; ".join(bad)
EOF
}

run_step() {  # run_step SCHEDULE REPORT [noratio] [options]: a run, then its report checked (noratio: not its time)
  local sched=$1 rep=$2 check=ratio
  shift 2
  [ "${1:-}" = noratio ] && { check=noratio; shift; }
  umopt run "$sched" --steps 5 --warmup 2 --no-select --report "$rep" "$@" && report_ok "$rep" "$check"
}

grads_step() {  # grads_step SCHEDULE DIR RTOL [options]: one step's gradients against one process
  local sched=$1 dir=$2 rtol=$3
  shift 3
  umopt run "$sched" --steps 1 --warmup 0 --no-select --save-grads "$dir" "$@" && python "$HERE/grad_check.py" "$sched" "$dir" --rtol "$rtol"
}

pipeline_step() {  # pipeline_step SCHEDULE RANKS: one step through umopt.Pipeline under torchrun, against one process
  python -m torch.distributed.run --standalone --nproc-per-node "$2" "$HERE/pipeline_check.py" "$1" \
    --backend "$BACKEND" --rtol 2e-2 | sed 's/^/SMOKE: /'
  return "${PIPESTATUS[0]}"
}

selection_step() {  # selection_step SCHEDULE REPORT: the file's candidates measured in turns, one kept
  umopt run "$1" --steps 40 --warmup 2 --report "$2" && python - "$2" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))["selection"]
assert s and s["steps"] > 0, f"selection measured nothing: {s and s['reason']}"
rows = ", ".join(f"{c['name']} {c['measured_ms']:.2f} ms (pred {c['predicted_ms']:.2f})" for c in s["candidates"] if c["measured_ms"])
print(f"SMOKE: kept {s['winner']} of {rows}: {s['reason']}")
EOF
}

step "environment ($DEVICE, $GPUS $UNIT)" "torch sees the device$([ "$DEVICE" = cuda ] && echo ', NCCL is there')" env_check

# --- sequences of different lengths on one GPU, first: what no GPU has run yet (issue 67) -------
varlen_ok() {  # varlen_ok PREFIX: each method's tokens/s and measured/predicted; its peak memory within 10% either way (GPUs)
  python - "$1" "$DEVICE" <<'EOF'
import json, sys
from pathlib import Path
prefix, device = sys.argv[1], sys.argv[2]
bad = []
for f in sorted(Path(prefix).parent.glob(Path(prefix).name + "*.json")):
    r = json.loads(f.read_text())
    ln = r["lengths"]
    mem = r.get("peak_memory_bytes") or {}
    peaks = [(m, p) for m, p in zip(mem.get("measured") or [], mem.get("predicted") or [])]
    shown = ", ".join(f"{m / 2**20:.1f}/{p / 2**20:.1f} MiB" for m, p in peaks)
    print(f"SMOKE: {ln['method']}: {ln['tokens_per_s']:,.0f} tokens/s (predicted {ln['predicted_tokens_per_s']:,.0f}), "
          f"measured/predicted {r['measured_over_predicted']:.2f}; peak memory measured/predicted {shown or '-'}")
    if device == "cuda":
        bad += [f"{ln['method']}: peak {m / p:.2f}x its plans'" for m, p in peaks if not 0.9 <= m / p <= 1.1]
assert not bad, "; ".join(bad)
EOF
}
varlen_run() {  # varlen_run PLAN PREFIX: umopt's, padding's and packing's plans in turns, each step planned ahead
  umopt run "$1" --lengths "chat/$((4096 / LONGEST))" --methods umopt,pad,pack --steps 4 --warmup 2 \
    --report "$2{name}.json" && varlen_ok "$2"
}
PV="$OUT/gpt-s1-lengths.json"
step "profile gpt S=1 over lengths" "costs by tokens fitted, packed and padded, up to $LONGEST tokens" \
  umopt profile "${GPT[@]}" --stages 1 --max-size "$MAX" --device "$DEVICE" --dtype bfloat16 --lengths "$LONGEST" --no-probes -o "$PV"
step "solve --lengths S=1" "umopt's plan beside padding, packing, DynaPipe, WLB-LLM" \
  umopt solve "$PV" -B "$VL_B" --lengths "chat/$((4096 / LONGEST))" --time-limit 5 -o "$OUT/plan-s1.json"
VMEM=$([ "$DEVICE" = cuda ] && echo "each method's peak memory within 10% of its plans', either way" || echo "(peak memory: checked on GPUs)")
step "run sequences S=1, 3 methods" "varlen attention, token rows, PlanAhead beside CUDA, the plan in the store each step; $VMEM" \
  varlen_run "$OUT/plan-s1.json" "$OUT/report-varlen-s1-"
if [ "$DEVICE" = cuda ]; then
  step "a packed forward, no host wait" "positions, varlen lengths and padded rows built without the host waiting for the GPU" \
    python "$HERE/sync_check.py"
else
  skip "a packed forward, no host wait" "needs a GPU (the check is of the host waiting for one)"
fi
if python -c "import transformers" 2>/dev/null; then
  PL="$OUT/llama-s1-lengths.json"
  step "profile transformers llama S=1 over lengths" "hf:llama cut into layers, costs by tokens" \
    umopt profile "${LLAMA[@]}" --stages 1 --max-size "$MAX" --device "$DEVICE" --dtype bfloat16 --lengths "$LONGEST" --no-probes -o "$PL"
  step "solve --lengths llama S=1" "umopt's plan of a transformers model" \
    umopt solve "$PL" -B "$VL_B" --lengths "chat/$((4096 / LONGEST))" --time-limit 5 -o "$OUT/plan-llama.json"
  step "run llama sequences S=1, 3 methods" "transformers' layers with umopt's attention; $VMEM" \
    varlen_run "$OUT/plan-llama.json" "$OUT/report-llama-s1-"
else
  skip "transformers llama over lengths" "transformers is not installed (pip install '.[hf]')"
fi

extra=()
[ "$RUN_STAGES" -gt 1 ] && extra=("${LINK[@]}")
PB="$OUT/gpt-s$RUN_STAGES-bfloat16.json"
links=$([ "$RUN_STAGES" -gt 1 ] && { [ ${#LINK[@]} -gt 0 ] && echo ", link given" || echo ", link measured"; })
step "profile gpt S=$RUN_STAGES bfloat16" "a profile$links; probe runs fitted it or said why not" \
  profile_step "$RUN_STAGES" bfloat16 "$PB" "${extra[@]}"
step "solve S=$RUN_STAGES bfloat16" "a valid schedule file with candidates, and its Gantt chart" \
  umopt solve "$PB" -B "$B" --time-limit 10 -o "$OUT/sched.json" --plot "$OUT/sched.png"
VIA=$([ "$RUN_STAGES" -gt 1 ] && echo "$RUN_STAGES ranks through $BACKEND" || echo "1 rank, no messages")
MEM=$([ "$DEVICE" = cuda ] && echo "peak memory within 10%" || echo "(peak memory: measured on GPUs only)")
step "run S=$RUN_STAGES, report and checkpoint" "$VIA; measured/predicted in 0.8-1.25; $MEM; a checkpoint set" \
  run_step "$OUT/sched.json" "$OUT/report.json" --plot "$OUT/measured.png" --checkpoint "$OUT/ck"
if [ "$RUN_STAGES" -lt 2 ]; then
  skip "selection S=1" "one stage: a solve has no candidates to measure in turns"
else
  step "selection S=$RUN_STAGES" "the schedule file's pick and candidates measured in turns over the first steps, one kept" \
    selection_step "$OUT/sched.json" "$OUT/report-select.json"
fi
step "gradients vs one process, bfloat16" "$VIA: one step's gradients equal one process's (rtol 2e-2)" \
  grads_step "$OUT/sched.json" "$OUT/grads" 2e-2

if [ "$GPUS" -lt 2 ]; then
  skip "several chunks per rank, V-shaped" "needs 2 $UNIT"
else
  step "profile gpt S=2 per layer" "layer by layer, the backward split (W ops)" layered_step 2 "$OUT/gpt-s2-layers.json"
  step "schedules V-shaped S=2" "torch's ZBV order on 2 ranks x 2 chunks" \
    python "$HERE/smoke_schedules.py" "$OUT/gpt-s2-layers.json" -B "$B" --out "$OUT/chunked2"
  step "run V-shaped S=2" "umopt run, 2 chunks per rank, W ops; $MEM" \
    run_step "$OUT/chunked2/vshape.json" "$OUT/report-vshape.json" noratio
  step "gradients V-shaped S=2" "umopt run: one step's gradients equal one process's (rtol 2e-2)" \
    grads_step "$OUT/chunked2/vshape.json" "$OUT/grads-vshape" 2e-2
  step "umopt.Pipeline V-shaped S=2" "a user's loop under torchrun, a list of chunk modules: one process's gradients" \
    pipeline_step "$OUT/chunked2/vshape.json" 2
fi

if [ "$GPUS" -lt 3 ]; then
  skip "looped, 3 ranks" "needs 3 $UNIT (a looped schedule's wrap link: NCCL's lazy connections)"
else
  step "profile gpt S=3 per layer" "layer by layer, links measured between the stages' $UNIT" layered_step 3 "$OUT/gpt-s3-layers.json"
  step "schedules looped S=3" "torch's interleaved 1F1B on 3 ranks x 2 chunks" \
    python "$HERE/smoke_schedules.py" "$OUT/gpt-s3-layers.json" -B "$B" --out "$OUT/chunked3"
  step "run looped S=3" "umopt run: the first step does not hang; $MEM" \
    run_step "$OUT/chunked3/looped.json" "$OUT/report-looped.json" noratio
  step "gradients looped S=3" "one step's gradients equal one process's (rtol 2e-2)" \
    grads_step "$OUT/chunked3/looped.json" "$OUT/grads-looped" 2e-2
  step "umopt.Pipeline looped S=3" "a user's loop under torchrun: one process's gradients" \
    pipeline_step "$OUT/chunked3/looped.json" 3
fi

if [ "$GPUS" -lt 4 ]; then
  skip "--dp 2" "needs 4 $UNIT (2 replicas of a 2-rank pipeline)"
else
  step "run --dp 2" "2 replicas x 2 ranks: all-reduce after the steps; gradients of the global minibatch" \
    grads_step "$OUT/sched.json" "$OUT/grads-dp" 2e-2 --dp 2
  step "run V-shaped --dp 2" "2 replicas x 2 ranks x 2 chunks" \
    grads_step "$OUT/chunked2/vshape.json" "$OUT/grads-vshape-dp" 2e-2 --dp 2
fi

# sequences of different lengths, planned per minibatch, against padding and packing (issue 57)
if [ "$DEVICE" = cuda ]; then VARLEN=(--max-length 2048 --minibatches 4 --size 32); else VARLEN=(--max-length 64 --minibatches 2 --size 8); fi
varlen_step() {  # the bench's table and figures, kept in OUT and shown in the PASS line's notes
  python "$HERE/varlen_measured.py" --device "$DEVICE" --samplers chat long-context --rounds 1 --markdown \
    "${VARLEN[@]}" >"$OUT/varlen.md" && grep -E '^(\| (chat|long-context) |- )' "$OUT/varlen.md" | sed 's/^/SMOKE: /'
}
if [ "$GPUS" -lt 2 ]; then
  skip "variable lengths, measured (2 ranks)" "needs 2 $UNIT (NCCL takes one rank per GPU)"
else
  step "variable lengths, measured (2 ranks)" "umopt's plans, padding, packing, DynaPipe in turns; tokens/s and measured/predicted" \
    varlen_step
fi

step "run --resume" "the checkpoint set read back and the run continued" \
  umopt run "$OUT/sched.json" --steps 2 --warmup 0 --no-select --checkpoint "$OUT/ck" --resume

fault() {  # fault KIND EXPECTED: the run fails with EXPECTED in its one line, within 60 s
  local t0=$SECONDS msg
  msg=$(UMOPT_FAULT="$FAULT_RANK:1:$1" timeout 90 umopt run "$OUT/sched.json" --steps 5 --warmup 0 --no-select 2>&1 >/dev/null)
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

P="$OUT/gpt-s$RUN_STAGES-float32.json"
step "profile gpt S=$RUN_STAGES float32" "a profile$links; probe runs fitted it or said why not" \
  profile_step "$RUN_STAGES" float32 "$P" "${extra[@]}"
step "solve S=$RUN_STAGES float32" "a valid schedule file" umopt solve "$P" -B "$B" --time-limit 10 -o "$OUT/sched-f32.json"
step "run S=$RUN_STAGES float32" "$VIA; measured/predicted in 0.8-1.25" run_step "$OUT/sched-f32.json" "$OUT/report-f32.json"
step "gradients vs one process, float32 (rtol $RTOL)" "$VIA: one step's gradients equal one process's" \
  grads_step "$OUT/sched-f32.json" "$OUT/grads-f32" "$RTOL"

tune_extra=()
[ "$RUN_STAGES" -gt 1 ] && tune_extra=("${LINK[@]}")
step "tune --device $DEVICE" "profile, solve, every candidate measured in turns, recommended.json written" \
  umopt tune "${GPT[@]}" --stages "$RUN_STAGES" --minibatch "$B" --device "$DEVICE" \
  --dtype bfloat16 "${tune_extra[@]}" --steps 4 --rounds 2 --time-limit 10 --out "$OUT/tune"

N=$((GPUS > 8 ? 8 : GPUS))
if [ "$DEVICE" != cuda ] || [ "$N" -le 3 ]; then
  skip "torchrun, all GPUs" "needs more than 3 GPUs"
else
  step "profile gpt S=$N, links measured" "$((N - 1)) links, disjoint pairs measured at once" \
    profile_step "$N" bfloat16 "$OUT/gpt-s$N-bfloat16.json"
  step "solve S=$N" "a valid schedule file" umopt solve "$OUT/gpt-s$N-bfloat16.json" -B "$B" --time-limit 10 -o "$OUT/sched-n.json"
  torchrun_n() {
    python -m torch.distributed.run --standalone --nproc-per-node "$N" -m umopt.cli run "$OUT/sched-n.json" \
      --steps 5 --warmup 2 --no-select --report "$OUT/report-n.json" && report_ok "$OUT/report-n.json"
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
    mem = r.get("peak_memory_bytes") or {}
    peak = ", ".join(f"{m / p:.2f}" for m, p in zip(mem.get("measured") or [], mem.get("predicted") or []))
    print(f"{f.name}: measured {r['measured_iteration_ms']:.2f} ms, predicted {r['predicted_iteration_ms']:.2f}, "
          f"measured/predicted {r['measured_over_predicted']:.3f}" + (f"; peak memory measured/predicted per rank {peak}" if peak else ""))
sel = out / "report-select.json"
if sel.exists():
    s = json.loads(sel.read_text())["selection"]
    if s:
        equal = min((c["measured_ms"] for c in s["candidates"] if c["equal"] and c["measured_ms"]), default=None)
        for c in s["candidates"]:
            if c["measured_ms"]:
                gain = f", {equal / c['measured_ms']:.3f}x the best equal" if equal else ""
                print(f"selection {c['name']}: measured {c['measured_ms']:.2f} ms, predicted {c['predicted_ms']:.2f}{gain}")
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
counts
[ "$FAILED" -eq 0 ]

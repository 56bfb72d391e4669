#!/usr/bin/env bash
# The numeric tests under every torch CPU capability this CPU has (ATEN_CPU_CAPABILITY: default, avx2, avx512) and at
# 1 and 2 threads. Each kernel set and thread count adds the same terms in another order, and every bound these tests
# compare with must hold for any order (trl_gspo/rounding.py). `make test-numeric` runs it; `.ci/run` runs it after
# `make test`, which ran the whole suite under the CPU's own capability at one thread, so that pass is left out there
# (NUMERIC_SKIP_NATIVE_ONE_THREAD=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

# The tests that compare floating-point results with a rounding bound, end-to-end training runs (marked slow) left to
# `make test`: whole files where nearly every test does, single tests elsewhere.
TESTS=(
    tests/test_rounding.py tests/test_padding.py tests/test_shared_prefix.py tests/test_parity.py
    tests/test_token_advantages.py tests/test_losses.py tests/test_loss_properties.py tests/test_segment_kernels.py
    tests/test_forward_syncs.py tests/test_sampler_logprobs.py
    tests/test_async.py::test_sync_vllm_flow_uses_length_normalized_correction_by_default
    tests/test_async.py::test_decoupled_loss_and_gradients_match_naive_reference
    tests/test_dynamic_sampling.py::test_prefilter_metrics_are_trls_formulas
    tests/test_dynamic_sampling.py::test_underfilled_batch_loss_and_gradients_match_a_hand_computation
    tests/test_dynamic_sampling.py::test_sampler_logprobs_of_kept_rows_are_pi_old
    tests/test_routing_replay.py::test_replaying_own_routes_is_bit_identical
    tests/test_routing_replay.py::test_replay_after_an_update_matches_a_naive_forced_forward
    tests/test_routing_replay.py::test_gradient_checkpointing_recomputes_on_the_replayed_routes
    tests/test_routing_replay.py::test_sentinel_positions_route_natively_and_bad_routes_raise
    tests/test_routing_replay.py::test_the_load_balancing_loss_stays_on_the_routers_own_picks
    tests/test_metrics.py::test_sequence_log_ratio_is_mean_over_valid_tokens
    tests/test_metrics.py::test_dispersion_and_length_buckets_by_hand
    tests/test_metrics.py::test_nonfinite_values_are_counted_and_left_out
    tests/test_metrics.py::test_metrics_reach_the_logs_for_every_variant
    tests/test_rollout.py::test_score_with_given_rewards_skips_the_reward_functions
)

capability() {  # the capability torch runs with ATEN_CPU_CAPABILITY=$1 (empty: unset, torch's own pick)
    if [ -n "$1" ]; then export ATEN_CPU_CAPABILITY="$1"; else unset ATEN_CPU_CAPABILITY; fi
    "$PYTHON" -c "import torch; print(torch.backends.cpu.get_cpu_capability())"
}

# torch does not cap a request at what the CPU can run: asked for avx512 on an AVX2-only CPU it reports AVX512 and
# dies on an illegal instruction. The capability torch picks unasked is the CPU's best; run it and those below it.
native=$(capability "")
case "$native" in
    AVX512) requests=(default avx2 avx512) ;;
    AVX2) requests=(default avx2) ;;
    *) requests=(default) ;;
esac
echo "torch's own CPU capability: $native; numeric tests under ${requests[*]}, at 1 and 2 threads"
SECONDS=0
for request in "${requests[@]}"; do
    ran=$(capability "$request")
    if [ "${ran,,}" != "$request" ]; then
        echo "asked torch for ATEN_CPU_CAPABILITY=$request, it runs $ran" >&2
        exit 1
    fi
    for threads in 1 2; do
        if [ "$ran" = "$native" ] && [ "$threads" = 1 ] && [ "${NUMERIC_SKIP_NATIVE_ONE_THREAD:-0}" = 1 ]; then
            echo "== $ran, 1 thread: the whole suite ran so (make test)"
            continue
        fi
        echo "== numeric tests: CPU capability $ran (ATEN_CPU_CAPABILITY=$request), $threads thread(s)"
        start=$SECONDS
        # OMP_WAIT_POLICY=passive: idle OpenMP threads sleep instead of spinning, which changes no arithmetic; on a
        # 2-core machine shared with other jobs, spinning made the 2-thread pass 8x slower than the 1-thread one.
        # -n auto: one worker per core over the thread count (tests/conftest.py), so 2 threads on 2 cores is one
        ATEN_CPU_CAPABILITY=$request OMP_NUM_THREADS=$threads TRL_GSPO_TEST_THREADS=$threads OMP_WAIT_POLICY=passive \
            "$PYTHON" -m pytest -q -p no:cacheprovider -n auto --dist worksteal -m "not slow" "${TESTS[@]}"
        echo "   ($((SECONDS - start)) s; $SECONDS s in all)"
    done
done

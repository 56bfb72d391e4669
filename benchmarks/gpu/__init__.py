"""The GPU checks of trl-gspo: `make gpu-check` (every check, about 40 minutes) and `make gpu-quick` (the forward path,
8 minutes); docs/gpu-check.md says what each part checks. One entry point, run from the checkout's root:

    python -m benchmarks.gpu --help

The modules, each importing only those below it (pyproject.toml's import contract for this folder, `make lint`):

    __main__                  the entry point: runs check.main
    check                     the driver: the parts, their needs and budgets, one child process per part, the results
    quick | parts | routes    the parts: the quick profile (probe, attention, its table); the full run's own parts
                              (bf16 parity, the demo, colocated vLLM, ZeRO); the vLLM route check
    passes                    the quick profile's `passes` and `loss`
    measure | env             the bottom: what the quick parts share (budgets, result file, timer, kernels, host-sync
                              guard); what the machine has and why a part cannot run on it

Modules on one line do not import each other. Each part's process is the same entry point (`--part NAME`, or
`routes`), so the parts run from the checkout exactly as the driver does.
"""

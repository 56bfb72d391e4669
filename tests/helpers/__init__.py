"""What the tests share and the scripts they launch in other processes: the tiny trainer runs of the fault and resume
tests (`fault_utils`, also a script), the CLI under `accelerate launch` on CPU (`cpu_launch`), the two-process dynamic
sampling run (`dynamic_sampling_worker`), the vLLM stand-ins (`vllm_stand_in`, also a script) and a free port for the
launches' rendezvous (`ports`)."""

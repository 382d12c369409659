"""The memory and speed planner: what a config needs on the train device and the host, per part,
before anything loads (docs/memory-and-offload.md, "Planning"). `plan_run` (run_plan.py) is the
entry point; `launch.py plan` prints it."""

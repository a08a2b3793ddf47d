"""The Ray runtime: engine, trainer and evaluator actors executing the driver's commands.

`ray_runtime.RayRuntime` runs one training job (a `RayRunPlan`) on local Ray or a cluster,
its calls in flight typed records (`calls`); `recovery` and
`trainer_recovery` replace dead actors mid-run; `local_ray`, `placement` and `threads`
start Ray, place the actors and share this machine's cores.
"""

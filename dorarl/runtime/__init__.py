"""The Ray runtime: engine, trainer and evaluator actors executing the driver's commands.

`ray_runtime.RayRuntime` runs one training job (a `RayRunPlan`) on local Ray or a cluster,
its calls in flight typed records (`calls`); `engines`, `trainer_client`, `rollout` and
`episodes` carry out the driver's commands; `workers/` holds the actors' classes,
`transfer/` moves weights and migrated KV between them, `recovery/` replaces dead actors
mid-run; `local_ray`, `placement` and `threads` start Ray, place the actors and share this
machine's cores.
"""

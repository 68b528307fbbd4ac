"""Shared helpers of the method scripts; none knows a method. A function takes what it uses: explicit values, or an
object made once (the launch's SplitLaunch, the sampler, the script's log-prob function). Those that take the script's
whole `args` read the run's configuration as such: check_args (every shared flag's check), open_run and checkpoints.save
(the run's identity, the saved flags a resume compares), models (the DeepSpeed engine from its flags), Tracker (wandb's
config is the flags), rollouts.collect_for and tracking.step_metrics (the rollout and step flags, 7-9 each), data (the
prompt length, the dataset's field names and the stream's layout) and the sampler (the engine's eight flags)."""

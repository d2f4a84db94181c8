"""rlproxy as a Tinker *client*: a learner (and optionally the sampler) on a Tinker service
elsewhere, through the official `tinker` SDK (the `tinker` extra). The proxy stays local:
front doors, sessions, records, scoring, the prefix cache, the dashboard.

  service.py  the SDK's clients from the settings, calls with a deadline, and which failures
              are the caller's (a wrong key, an unknown base model: LearnerRefused) and which
              are the service's (down, slow, failing: LearnerUnavailable, retried)
  datums.py   training examples as Tinker Datums (ids, behaviour log-probs, advantages)
  weights.py  a run's weights downloaded (mlx-lm's layout or PEFT's) and fitted to the local
              base model's LoRA layout
  learner.py  RemoteLearner: the calls of training/learner.py's LocalLearner, on the service
  sampler.py  --sampler tinker: TinkerSampler in the engine's place (a SamplingClient per
              weights path; `publish_sampler` after each sync)
  judge.py    --judge-url / --teacher-url tinker: the judge and OPD teacher on the service's
              base model

Not here: the Tinker API this process *serves* (tinker/), the training loop (training/).
"""

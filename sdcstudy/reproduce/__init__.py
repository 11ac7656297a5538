"""`sdcstudy reproduce`: Ma et al.'s published results, node by node, measured and judged
where our runs can make them (Tables 3/5, Figure 7 and D.4 are rows saying why they cannot).

- `plan`: the runs (four per paper node: lockstep, paramsync, free, abft), their built-in
  configs, the shards, and what each run's profile leads us to expect;
- `bands`: the band and verdict of every kind of published number, and the scorecard row;
- `mismatch_rows`: Tables 1, 2 and 6-9 from the lock-step runs;
- `training_rows`: Figures 5, 6 and 10 from the parameter-sync, free and ABFT runs;
- `exposure_rows`: Tables 2, 8 and 9 at the paper's exposure, with the scatter of its maximum;
  `flip_exposure` the same under the flip model, from the law of the maximum its bit law gives;
- `abft_paper_scale`: Figure 10 at the paper's sizes, the profiles' attention faults in
  float32 products of the paper's shapes checked as ABFT does (numpy, no run), and
  `figure10_paper` its rows, the analytic estimate judging where the draws are too few to;
- `pass_chance`: the chance a correct model passes the rows that are tests or maxima;
  `seed_scatter` Figures 5-6's, from the verdicts of runs with other fault seeds;
- `claim_rows`: the published results beyond the bands (Figures 3-4, 5's shape, 6's gradient
  norms, 7, C.2, D.3, Tables 3/5) and those no run makes;
- `scorecard`: the rows of a folder of runs, as Markdown, CSV and JSON; `scorecard_read`
  reads a scorecard.md back (tests of the numbers docs quote, derived JSON);
- `figures`: ours against the published numbers, and the free runs over their steps;
- `cli`: the command, `--resume`, `--shard` and `--merge`.

docs/reproduction.md explains the bands and how to shard on Slurm. Only `plan.build` and
`cli.reproduce` import JAX (to run); scoring a folder does not.
"""

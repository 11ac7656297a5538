"""Developer tools: the README's tour (`python -m sdcstudy.dev.tour`), the bits every mode
computes, recorded and compared across a refactor (`python -m sdcstudy.dev.mode_bits`), and
Figure 10 at the paper's sizes measured into the scorecard's input
(`python -m sdcstudy.dev.figure10_entries`), and Figures 5-6's seed-to-seed scatter collected
into another (`python -m sdcstudy.dev.seed_scatter`)."""

"""Developer tools: the README's tour (`python -m sdcstudy.dev.tour`) and the bits every mode
computes, recorded and compared across a refactor (`python -m sdcstudy.dev.mode_bits`)."""

"""Ma et al.'s per-decoder-layer measurements (Appendix C, Tables 6-9), without JAX.

Ma et al., "Understanding Silent Data Corruption in LLM Training", measured on the 16-layer
Llama3-8B-style model of section 4 in bfloat16 at tp=8:
- Table 6: mismatch frequency of the forward sites per layer, averaged over microsteps;
- Table 7: the same for the backward sites (rows from layer 16 down, as the backward pass
  meets them);
- Table 8: maximum mismatch severity of the forward sites per layer, over microsteps;
- Table 9: the same for the backward sites.
Each table is {(layer, site): one value per node of its column tuple}; layers are the paper's,
1 to 16. The tables leave out the nodes with no mismatch in that direction: Tables 6 and 8
have the columns of `FWD_NODES`, Tables 7 and 9 those of `BWD_NODES`.

Parsed from a text extraction of the paper, in which every table has all 16 layer rows. An
earlier extraction was reported to have lost Table 6's layer-1 row; it is present here
(node 1: 2.84e-5 and 5.17e-7), and with it the 16-layer averages of Table 6 reproduce Table 1
to the rounding of the printed values, which they would not without it.

Where the paper disagrees with itself, beyond the rounding of its printed digits (three
significant digits; tests/test_reproduce.py finds exactly `SELF_DISAGREEMENTS`):
- Table 9's largest layer value against Table 2: node 9 bwd/attn, 3.758e11 (layer 16, printed
  with four digits) against 3.79e11, 0.8% apart; node 5 bwd/attn, 0.0048 (layer 3) against
  0.0047, 2%; and in the last printed digit node 9 bwd/ffn (9.621e12 against 9.63e12) and
  node 14 bwd/ffn (0.3789 against 0.380);
- Table 7's mean over layers against Table 1: node 10 bwd/ffn, 7.969e-5 against 7.98e-5, a
  last-digit difference just beyond what rounding the 16 layer values explains. Every other
  mean of Tables 6-7 is Table 1's value and every other maximum of Tables 8-9 is Table 2's;
- captions: Table 7's says nodes 2, 3, 5, 12 and 13 show no backward mismatch, yet its columns
  hold nodes 5 and 13 with non-zero values (as Table 1 does); Table 9's says "forward passes"
  and excludes only nodes 2, 3 and 12, which is what Tables 7 and 9 hold.
A layer with zero frequency has zero severity and the other way round, in both directions.
"""

from __future__ import annotations

from sdcstudy.faults.published import SITES

PAPER_LAYERS = 16  # section 4 and appendix C: a 16-layer model
FWD_NODES = (1, 4, 6, 7, 8, 9, 10, 11, 14)  # the columns of Tables 6 and 8
BWD_NODES = (1, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15)  # the columns of Tables 7 and 9
# (table, node, site): (Table 1's or Table 2's value, the mean or maximum over the table's 16
# layers) where the two differ beyond rounding; see the module docstring.
SELF_DISAGREEMENTS = {
    ("Table 9", 5, "bwd/attn"): (0.0047, 0.0048),
    ("Table 9", 9, "bwd/attn"): (3.79e11, 3.758e11),
    ("Table 9", 9, "bwd/ffn"): (9.63e12, 9.621e12),
    ("Table 9", 14, "bwd/ffn"): (0.38, 0.3789),
    ("Table 7", 10, "bwd/ffn"): (7.98e-5, 7.96875e-5),
}

# Table 6: forward mismatch frequency per layer, averaged over microsteps (columns: FWD_NODES).
TABLE6_FWD_FREQUENCY = {
    (1, "fwd/attn"): (2.84e-05, 3.31e-09, 0, 1.02e-06, 1.59e-09, 2.92e-06, 0, 1.43e-02, 0),
    (1, "fwd/ffn"): (5.17e-07, 4.37e-11, 0, 5.18e-07, 9.95e-12, 1.52e-07, 9.75e-06, 2.40e-03, 0),
    (2, "fwd/attn"): (1.45e-05, 2.47e-09, 3.89e-09, 2.94e-06, 1.70e-09, 9.83e-06, 8.62e-04,
        3.89e-02, 1.82e-10),
    (2, "fwd/ffn"): (2.86e-07, 1.02e-10, 2.39e-14, 3.48e-08, 1.42e-11, 2.58e-07, 2.18e-04,
        2.04e-03, 0),
    (3, "fwd/attn"): (9.94e-06, 1.78e-09, 0, 1.76e-06, 4.44e-09, 6.31e-06, 1.78e-03, 2.67e-02, 0),
    (3, "fwd/ffn"): (5.21e-07, 1.42e-10, 0, 9.43e-08, 6.45e-12, 3.74e-07, 4.75e-04, 2.24e-03, 0),
    (4, "fwd/attn"): (8.82e-06, 2.40e-09, 0, 2.02e-06, 3.86e-09, 5.24e-06, 1.63e-03, 2.02e-02,
        2.61e-10),
    (4, "fwd/ffn"): (4.83e-07, 1.05e-10, 0, 5.85e-08, 1.85e-11, 3.84e-07, 4.66e-04, 2.38e-03, 0),
    (5, "fwd/attn"): (1.10e-05, 2.99e-09, 0, 1.99e-06, 2.45e-09, 6.85e-06, 2.77e-03, 2.34e-02,
        3.11e-10),
    (5, "fwd/ffn"): (4.96e-07, 9.04e-11, 0, 1.07e-07, 6.52e-12, 3.53e-07, 6.79e-04, 2.19e-03, 0),
    (6, "fwd/attn"): (1.23e-05, 3.57e-09, 0, 2.13e-06, 5.14e-10, 8.70e-06, 3.98e-03, 2.59e-02, 0),
    (6, "fwd/ffn"): (6.07e-07, 1.27e-10, 8.67e-11, 1.35e-07, 2.77e-11, 4.48e-07, 9.17e-04,
        2.36e-03, 0),
    (7, "fwd/attn"): (1.05e-05, 1.29e-09, 2.33e-08, 1.78e-06, 1.03e-08, 5.37e-06, 4.39e-03,
        2.15e-02, 0),
    (7, "fwd/ffn"): (6.27e-07, 9.07e-11, 0, 1.20e-07, 7.15e-11, 4.72e-07, 1.18e-03, 2.36e-03, 0),
    (8, "fwd/attn"): (1.69e-05, 3.78e-09, 0, 2.14e-06, 4.47e-09, 1.13e-05, 5.08e-03, 2.91e-02, 0),
    (8, "fwd/ffn"): (5.01e-07, 1.28e-10, 0, 1.43e-07, 1.24e-11, 5.12e-07, 1.19e-03, 2.32e-03, 0),
    (9, "fwd/attn"): (1.61e-05, 1.04e-08, 2.39e-14, 2.45e-06, 2.12e-09, 1.70e-05, 6.94e-03,
        3.63e-02, 1.02e-10),
    (9, "fwd/ffn"): (6.52e-07, 1.03e-10, 0, 1.27e-07, 6.00e-11, 5.22e-07, 1.44e-03, 2.23e-03, 0),
    (10, "fwd/attn"): (1.36e-05, 1.74e-09, 8.56e-11, 2.34e-06, 8.23e-09, 1.45e-05, 6.57e-03,
        3.20e-02, 0),
    (10, "fwd/ffn"): (5.62e-07, 6.93e-11, 0, 1.38e-07, 8.89e-12, 5.67e-07, 1.40e-03, 2.19e-03, 0),
    (11, "fwd/attn"): (1.96e-05, 4.25e-09, 0, 2.29e-06, 7.92e-11, 1.46e-05, 6.78e-03, 3.45e-02, 0),
    (11, "fwd/ffn"): (5.03e-07, 7.97e-11, 8.68e-11, 9.69e-08, 8.55e-12, 6.67e-07, 1.36e-03,
        2.23e-03, 0),
    (12, "fwd/attn"): (1.97e-05, 3.46e-09, 0, 2.58e-06, 2.03e-09, 1.50e-05, 6.81e-03, 3.49e-02, 0),
    (12, "fwd/ffn"): (5.63e-07, 7.24e-11, 8.88e-11, 1.10e-07, 9.51e-12, 6.78e-07, 1.35e-03,
        2.38e-03, 0),
    (13, "fwd/attn"): (2.28e-05, 9.72e-09, 8.21e-11, 3.01e-06, 4.83e-14, 1.86e-05, 7.05e-03,
        4.09e-02, 8.56e-11),
    (13, "fwd/ffn"): (4.35e-07, 8.06e-11, 0, 5.00e-08, 5.72e-12, 6.67e-07, 1.26e-03, 2.20e-03, 0),
    (14, "fwd/attn"): (1.78e-05, 3.91e-09, 4.79e-14, 2.37e-06, 4.67e-09, 1.47e-05, 7.66e-03,
        3.50e-02, 0),
    (14, "fwd/ffn"): (3.83e-07, 6.99e-11, 2.39e-14, 2.84e-08, 8.84e-12, 7.20e-07, 1.49e-03,
        2.13e-03, 0),
    (15, "fwd/attn"): (1.39e-05, 1.33e-09, 0, 1.75e-06, 2.81e-09, 1.31e-05, 7.18e-03, 2.61e-02, 0),
    (15, "fwd/ffn"): (4.66e-07, 8.00e-11, 0, 8.01e-08, 4.49e-11, 6.76e-07, 1.65e-03, 2.20e-03, 0),
    (16, "fwd/attn"): (1.25e-05, 4.28e-09, 4.79e-14, 1.43e-06, 2.02e-09, 1.11e-05, 6.93e-03,
        2.43e-02, 9.60e-11),
    (16, "fwd/ffn"): (4.86e-07, 8.85e-11, 0, 4.40e-08, 5.02e-12, 6.33e-07, 1.46e-03, 2.11e-03, 0),
}

# Table 7: backward mismatch frequency per layer (columns: BWD_NODES), layer 16 first.
TABLE7_BWD_FREQUENCY = {
    (16, "bwd/ffn"): (3.12e-06, 5.89e-11, 6.21e-13, 0, 7.04e-08, 2.55e-09, 3.71e-08, 7.89e-05,
        9.92e-05, 4.91e-11, 1.44e-09, 7.09e-14),
    (16, "bwd/attn"): (2.11e-04, 3.08e-09, 0, 0, 4.44e-06, 1.40e-07, 5.57e-06, 2.59e-03, 7.19e-03,
        0, 3.09e-10, 0),
    (15, "bwd/ffn"): (3.11e-06, 6.19e-11, 1.58e-12, 0, 7.21e-08, 2.46e-09, 3.87e-08, 8.45e-05,
        1.06e-04, 9.57e-11, 7.33e-10, 0),
    (15, "bwd/attn"): (1.81e-04, 2.10e-09, 0, 0, 4.07e-06, 1.22e-07, 5.07e-06, 2.43e-03, 6.56e-03,
        0, 0, 0),
    (14, "bwd/ffn"): (3.09e-06, 1.87e-11, 1.46e-12, 2.13e-11, 6.89e-08, 2.43e-09, 4.12e-08,
        8.10e-05, 1.02e-04, 1.33e-10, 2.14e-09, 0),
    (14, "bwd/attn"): (2.63e-04, 2.24e-09, 0, 0, 5.96e-06, 1.62e-07, 6.75e-06, 2.78e-03, 8.51e-03,
        0, 1.64e-11, 0),
    (13, "bwd/ffn"): (3.09e-06, 2.08e-11, 4.06e-12, 4.74e-10, 7.04e-08, 2.45e-09, 4.02e-08,
        8.03e-05, 1.01e-04, 3.24e-10, 9.38e-10, 2.36e-14),
    (13, "bwd/attn"): (2.85e-04, 8.18e-09, 0, 6.14e-10, 6.88e-06, 1.89e-07, 7.73e-06, 2.70e-03,
        8.91e-03, 0, 4.79e-14, 0),
    (12, "bwd/ffn"): (3.08e-06, 3.69e-11, 1.62e-12, 3.45e-11, 7.37e-08, 2.43e-09, 4.19e-08,
        8.54e-05, 1.13e-04, 1.23e-10, 6.67e-10, 0),
    (12, "bwd/attn"): (2.48e-04, 3.10e-09, 0, 0, 6.49e-06, 1.56e-07, 6.14e-06, 2.56e-03, 8.17e-03,
        0, 2.39e-14, 0),
    (11, "bwd/ffn"): (3.05e-06, 2.71e-11, 5.02e-13, 2.98e-11, 7.21e-08, 2.35e-09, 4.24e-08,
        8.55e-05, 1.06e-04, 1.70e-10, 1.04e-09, 0),
    (11, "bwd/attn"): (2.00e-04, 4.44e-09, 0, 0, 4.82e-06, 1.21e-07, 5.52e-06, 2.30e-03, 7.42e-03,
        0, 7.18e-14, 0),
    (10, "bwd/ffn"): (3.02e-06, 2.42e-11, 3.35e-13, 0, 7.83e-08, 2.34e-09, 4.00e-08, 8.64e-05,
        1.00e-04, 3.44e-11, 1.49e-09, 0),
    (10, "bwd/attn"): (1.65e-04, 2.88e-09, 0, 5.40e-10, 4.48e-06, 1.05e-07, 5.13e-06, 2.30e-03,
        6.94e-03, 0, 2.39e-14, 0),
    (9, "bwd/ffn"): (2.97e-06, 2.79e-11, 3.01e-12, 0, 7.12e-08, 2.32e-09, 3.99e-08, 8.70e-05,
        1.09e-04, 2.41e-10, 5.32e-10, 0),
    (9, "bwd/attn"): (1.77e-04, 4.29e-09, 0, 0, 4.65e-06, 1.20e-07, 5.41e-06, 2.38e-03, 7.29e-03,
        0, 3.03e-10, 0),
    (8, "bwd/ffn"): (2.91e-06, 2.29e-11, 1.19e-13, 0, 7.08e-08, 2.26e-09, 4.05e-08, 8.10e-05,
        1.12e-04, 6.64e-11, 3.18e-10, 0),
    (8, "bwd/attn"): (1.31e-04, 4.38e-09, 0, 0, 3.70e-06, 8.33e-08, 3.62e-06, 1.91e-03, 6.14e-03,
        0, 4.79e-14, 0),
    (7, "bwd/ffn"): (2.83e-06, 2.09e-11, 2.70e-12, 0, 6.70e-08, 2.21e-09, 3.95e-08, 8.51e-05,
        1.12e-04, 1.04e-10, 2.98e-09, 0),
    (7, "bwd/attn"): (9.79e-05, 1.14e-09, 0, 1.96e-08, 2.91e-06, 6.57e-08, 2.35e-06, 1.77e-03,
        5.66e-03, 0, 2.39e-14, 0),
    (6, "bwd/ffn"): (2.73e-06, 2.90e-11, 2.44e-12, 3.31e-11, 6.51e-08, 2.15e-09, 3.92e-08,
        7.85e-05, 1.13e-04, 1.74e-10, 3.99e-09, 2.36e-14),
    (6, "bwd/attn"): (1.05e-04, 1.66e-09, 0, 0, 2.98e-06, 6.47e-08, 3.14e-06, 1.54e-03, 5.96e-03,
        0, 2.85e-10, 0),
    (5, "bwd/ffn"): (2.63e-06, 2.75e-11, 9.56e-14, 0, 5.98e-08, 2.07e-09, 3.72e-08, 7.64e-05,
        1.06e-04, 2.26e-10, 8.34e-09, 0),
    (5, "bwd/attn"): (9.13e-05, 3.35e-09, 0, 0, 3.19e-06, 5.74e-08, 2.67e-06, 1.29e-03, 5.54e-03,
        0, 1.73e-09, 0),
    (4, "bwd/ffn"): (2.54e-06, 2.14e-11, 7.17e-14, 0, 5.38e-08, 2.02e-09, 3.77e-08, 7.44e-05,
        1.13e-04, 8.00e-11, 3.22e-09, 0),
    (4, "bwd/attn"): (7.84e-05, 1.84e-09, 0, 1.27e-10, 2.97e-06, 5.82e-08, 2.28e-06, 1.05e-03,
        5.14e-03, 0, 1.70e-09, 0),
    (3, "bwd/ffn"): (2.43e-06, 2.24e-11, 7.17e-14, 0, 5.32e-08, 1.97e-09, 3.78e-08, 7.65e-05,
        1.07e-04, 3.70e-11, 8.23e-09, 0),
    (3, "bwd/attn"): (6.95e-05, 1.62e-09, 2.39e-14, 0, 2.56e-06, 4.71e-08, 2.45e-06, 1.05e-03,
        5.87e-03, 0, 2.24e-09, 0),
    (2, "bwd/ffn"): (2.28e-06, 1.63e-11, 0, 0, 4.31e-08, 1.80e-09, 3.36e-08, 6.95e-05, 1.02e-04,
        7.85e-12, 2.47e-09, 0),
    (2, "bwd/attn"): (8.15e-05, 1.15e-09, 0, 3.03e-09, 3.86e-06, 6.08e-08, 3.32e-06, 1.06e-03,
        7.60e-03, 0, 1.27e-09, 0),
    (1, "bwd/ffn"): (2.12e-06, 1.14e-11, 1.34e-12, 3.70e-10, 8.74e-08, 1.62e-09, 3.03e-08,
        6.46e-05, 1.33e-04, 6.57e-11, 9.29e-09, 0),
    (1, "bwd/attn"): (1.03e-04, 2.30e-09, 0, 0, 5.05e-06, 5.76e-08, 2.10e-06, 1.07e-03, 4.40e-03,
        0, 2.39e-14, 0),
}

# Table 8: forward maximum mismatch severity per layer, over microsteps (columns: FWD_NODES).
TABLE8_FWD_SEVERITY = {
    (1, "fwd/attn"): (1.82, 0.3047, 0, 4.7812, 13.5, 0.15039063, 0, 25.875, 0),
    (1, "fwd/ffn"): (63.25, 0.0512, 0, 16.625, 0.3867, 21.625, 2.6875, 442, 0),
    (2, "fwd/attn"): (1.04, 0.3515, 0.0366, 24.625, 0.1289, 1.4140625, 4.84375, 90.5, 0.4746),
    (2, "fwd/ffn"): (312, 0.0266, 1, 1.3046, 0.0981, 60.25, 80, 668, 0),
    (3, "fwd/attn"): (3.97, 2.9531, 0, 6.125, 2.7031, 6.4375, 12.9375, 230, 0),
    (3, "fwd/ffn"): (84.5, 0.0439, 0, 9.8125, 0.2793, 15.5625, 42.5, 848, 0),
    (4, "fwd/attn"): (4.91, 0.375, 0, 6.8438, 0.7148, 4.59375, 24.25, 188, 1.1172),
    (4, "fwd/ffn"): (92, 0.8555, 0, 1.7734, 0.7734, 130, 145, 640, 0),
    (5, "fwd/attn"): (11.63, 0.1699, 0, 9.375, 0.6406, 7.75, 1120, 127, 0.3613),
    (5, "fwd/ffn"): (18.38, 0.0556, 0, 17.125, 0.1338, 30.75, 118, 708, 0),
    (6, "fwd/attn"): (99, 0.3281, 0, 11.9375, 4.2187, 16.5, 58.75, 152, 0),
    (6, "fwd/ffn"): (143, 0.0737, 0.0933, 25, 4.0312, 24.75, 67.5, 298, 0),
    (7, "fwd/attn"): (14.63, 0.1069, 0.3847, 43.25, 0.7695, 12.9375, 74.5, 76.5, 0),
    (7, "fwd/ffn"): (88.5, 0.0181, 0, 2.4219, 0.1719, 200, 40.5, 334, 0),
    (8, "fwd/attn"): (12.94, 0.0933, 0, 6.9375, 0.5898, 7.15625, 36.75, 76, 0),
    (8, "fwd/ffn"): (145, 0.0913, 0, 6.125, 4.375, 97, 47.25, 422, 0),
    (9, "fwd/attn"): (38.5, 0.7852, 0.9961, 1.9063, 1.1016, 18.25, 67, 318, 0.0786),
    (9, "fwd/ffn"): (148, 0.0579, 0, 25.625, 5.6875, 21.875, 53, 214, 0),
    (10, "fwd/attn"): (9.81, 1.125, 0.1289, 4.5938, 4.8125, 6.46875, 42.75, 136, 0),
    (10, "fwd/ffn"): (119.5, 0.0287, 0, 28.375, 0.1533, 30.625, 107.5, 398, 0),
    (11, "fwd/attn"): (11.69, 0.165, 0, 6.0625, 0.6015, 14.3125, 53, 121, 0),
    (11, "fwd/ffn"): (33.75, 0.0425, 0.1064, 13.8125, 1.3437, 35, 76.5, 346, 0),
    (12, "fwd/attn"): (25.5, 0.2832, 0, 25.75, 0.416, 3.21875, 27.625, 34, 0),
    (12, "fwd/ffn"): (23.25, 0.0349, 1, 88.5, 0.4394, 139, 262, 296, 0),
    (13, "fwd/attn"): (1.36, 0.4648, 0.3632, 3.4843, 0.0054, 4.78125, 43.75, 48.5, 0.0198),
    (13, "fwd/ffn"): (37.75, 1.4609, 0, 7.8437, 0.3105, 18.75, 80.5, 976, 0),
    (14, "fwd/attn"): (2.58, 0.4102, 1.0078, 7.25, 0.2617, 4.96875, 93.5, 28.5, 0),
    (14, "fwd/ffn"): (36.5, 0.0232, 0.9961, 5.8125, 0.21875, 79.5, 73.5, 432, 0),
    (15, "fwd/attn"): (2.25, 0.0928, 0, 7.2813, 0.1445, 12.5625, 47.25, 49.25, 0),
    (15, "fwd/ffn"): (97.5, 0.0322, 0, 1.6953, 0.5, 23.375, 31.625, 366, 0),
    (16, "fwd/attn"): (11.94, 0.9023, 1, 4.625, 0.0971, 119, 40.75, 103, 0.4707),
    (16, "fwd/ffn"): (39.75, 0.0273, 0, 1.6641, 0.1035, 115, 45.75, 536, 0),
}

# Table 9: backward maximum mismatch severity per layer (columns: BWD_NODES), layer 16 first.
TABLE9_BWD_SEVERITY = {
    (16, "bwd/ffn"): (0.7383, 0.0942, 0.0376, 0, 0.1367, 0.1143, 9.621e+12, 0.1436, 236, 0.0588,
        0.0757, 0.0053),
    (16, "bwd/attn"): (1256, 0.3223, 0, 0, 2.0938, 3.3281, 3.758e+11, 1.1094, 13.1875, 0, 0.0344,
        0),
    (15, "bwd/ffn"): (0.9023, 0.2598, 0.0206, 0, 0.1406, 0.7266, 8.934e+12, 0.2129, 127, 0.2344,
        0.0564, 0),
    (15, "bwd/attn"): (968, 0.1885, 0, 0, 1.3516, 0.4648, 3.737e+11, 0.3828, 8.4375, 0, 0, 0),
    (14, "bwd/ffn"): (1.5156, 0.3359, 0.0223, 0.0267, 0.0972, 0.8008, 6.769e+12, 0.4805, 692,
        0.3164, 0.1245, 0),
    (14, "bwd/attn"): (1040, 1.1641, 0, 0, 1.1563, 6.4063, 1.154e+11, 0.3125, 39.75, 0, 0.0165, 0),
    (13, "bwd/ffn"): (3.875, 0.5117, 0.0679, 0.0371, 0.2676, 0.1338, 8.212e+12, 0.1563, 352,
        0.0674, 0.0596, 0.0176),
    (13, "bwd/attn"): (7392, 2.0313, 0, 0.0469, 0.707, 0.1318, 1.943e+11, 0.3145, 9.3125, 0,
        0.0791, 0),
    (12, "bwd/ffn"): (2.7656, 0.3398, 0.0908, 0.0309, 0.2969, 0.1914, 5.429e+12, 0.2559, 1800,
        0.1768, 0.0608, 0),
    (12, "bwd/attn"): (1640, 0.3633, 0, 0, 0.9961, 4, 2.212e+11, 0.3379, 68.5, 0, 0.0075, 0),
    (11, "bwd/ffn"): (0.6641, 0.4434, 0.031, 0.0525, 0.2061, 0.125, 8.624e+12, 0.1631, 7680,
        0.1299, 0.0781, 0),
    (11, "bwd/attn"): (1992, 0.2852, 0, 0, 1.3516, 0.1143, 1.75e+11, 0.5625, 2208, 0, 0.0952, 0),
    (10, "bwd/ffn"): (0.7852, 1.0078, 0.0078, 0, 0.1709, 1.3359, 5.601e+12, 0.1924, 332, 0.0571,
        0.1494, 0),
    (10, "bwd/attn"): (3488, 1.5, 0, 0.0625, 1.6406, 0.2793, 1.299e+11, 0.8828, 55.25, 0, 0.0272,
        0),
    (9, "bwd/ffn"): (0.6914, 0.1025, 0.0209, 0, 0.0977, 1.5938, 4.948e+12, 0.3184, 1776, 0.0449,
        0.0562, 0),
    (9, "bwd/attn"): (4672, 1.1484, 0, 0, 0.8086, 0.6719, 2.835e+11, 0.2539, 77.5, 0, 0.0239, 0),
    (8, "bwd/ffn"): (0.6445, 0.1289, 0.0164, 0, 0.1196, 0.1816, 3.522e+12, 0.6367, 256, 0.0718,
        0.1367, 0),
    (8, "bwd/attn"): (864, 1.8359, 0, 0, 1.1172, 1.5469, 9.073e+10, 0.7617, 29.5, 0, 0.0124, 0),
    (7, "bwd/ffn"): (0.6406, 0.2539, 0.0679, 0, 0.1021, 0.104, 4.364e+12, 0.2119, 1880, 0.1045,
        0.1465, 0),
    (7, "bwd/attn"): (748, 0.3027, 0, 0.1621, 7.6563, 0.3359, 7.999e+10, 4, 104.5, 0, 0.0266, 0),
    (6, "bwd/ffn"): (0.4434, 0.1826, 0.032, 0.0322, 0.0835, 0.5, 2.749e+12, 0.2656, 173, 0.1172,
        0.1084, 0.0082),
    (6, "bwd/attn"): (3248, 0.8242, 0, 0, 5.3438, 0.9102, 7.892e+10, 12.75, 76, 0, 0.0223, 0),
    (5, "bwd/ffn"): (0.332, 0.6172, 0.008, 0, 0.1533, 0.104, 2.233e+12, 0.6484, 1016, 0.0742,
        0.3789, 0),
    (5, "bwd/attn"): (664, 0.5469, 0, 0, 6.4063, 0.6875, 7.087e+10, 0.9492, 190, 0, 0.3828, 0),
    (4, "bwd/ffn"): (0.4883, 0.2852, 0.0082, 0, 0.1074, 0.1738, 1.563e+12, 0.2246, 334, 0.0664,
        0.0781, 0),
    (4, "bwd/attn"): (1784, 0.1816, 0, 0.0356, 3.6094, 0.1895, 8.536e+10, 3.375, 304, 0, 3.7969,
        0),
    (3, "bwd/ffn"): (0.4043, 5.375, 0.0093, 0, 0.1729, 0.1064, 1.623e+12, 0.2178, 556, 0.0879,
        0.2295, 0),
    (3, "bwd/attn"): (1020, 2.3906, 0.0048, 0, 1.6172, 0.5, 9.342e+10, 1.0859, 74, 0, 1.0156, 0),
    (2, "bwd/ffn"): (1.6328, 0.8008, 0, 0, 0.1387, 0.0796, 1.512e+12, 0.1416, 836, 0.1157, 0.1128,
        0),
    (2, "bwd/attn"): (644, 0.3594, 0, 0.0537, 0.9844, 0.208, 8.966e+10, 1.3359, 216, 0, 2.25, 0),
    (1, "bwd/ffn"): (0.668, 0.1152, 0.0195, 0.0776, 0.1641, 0.0801, 1.044e+12, 0.2344, 406, 0.0356,
        0.127, 0),
    (1, "bwd/attn"): (596, 0.3535, 0, 0, 32.25, 0.1436, 1.463e+10, 0.2676, 241, 0, 0.2656, 0),
}

# source name -> (table, its node columns, "freq" or "severity")
LAYER_TABLES = {
    "Table 6": (TABLE6_FWD_FREQUENCY, FWD_NODES, "freq"),
    "Table 7": (TABLE7_BWD_FREQUENCY, BWD_NODES, "freq"),
    "Table 8": (TABLE8_FWD_SEVERITY, FWD_NODES, "severity"),
    "Table 9": (TABLE9_BWD_SEVERITY, BWD_NODES, "severity"),
}


def layer_values(source: str, node: int, site: str) -> tuple[float, ...] | None:
    """The 16 values of `node` at `site` in `source` ("Table 6" ... "Table 9"), layer 1 first;
    None where the table has no column for the node or does not hold the site."""
    table, nodes, _ = LAYER_TABLES[source]
    if node not in nodes or (1, site) not in table:
        return None
    column = nodes.index(node)
    return tuple(table[(layer, site)][column] for layer in range(1, PAPER_LAYERS + 1))


def layer_range(source: str, node: int, site: str) -> tuple[float, float] | None:
    """(min, max) over the paper's 16 layers of `layer_values`, or None."""
    values = layer_values(source, node, site)
    return None if values is None else (min(values), max(values))


def tables_for(site: str) -> tuple[str, str]:
    """The frequency and the severity table of a site: ("Table 6", "Table 8") for fwd/..."""
    if site not in SITES:
        raise ValueError(f"{site!r} is not one of {', '.join(SITES)}")
    return ("Table 6", "Table 8") if site.startswith("fwd/") else ("Table 7", "Table 9")

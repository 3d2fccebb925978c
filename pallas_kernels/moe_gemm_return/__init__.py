"""Grouped GEMM + return (Comet layer 1): expert output tiles go back to their tokens' owners as they are
computed, where each token sums its top-k, weighted."""

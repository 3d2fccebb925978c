"""GEMM + reduce-scatter (Flux): output blocks travel to their owner, summed on the way, as they are made."""

"""Speed: kernels, the float64 reference and the harness per case (`bench`), and the cost of the
guards a case is judged behind (`guard_bench`)."""

"""The second zoo: implementations that misbehave the way unfinished kernels do (raise, crash,
hang, give different answers run to run, write into their inputs, break the return contract,
change the process for the cases after them, tamper with the judge, return static buffers),
each with the outcome mla-verify must give it. `cpu.py` runs in CI (tests/test_hostile.py);
`cuda.py` needs a GPU (tests/test_hostile_gpu.py and `scripts/gpu_lane.sh hostile`); `graph.py`
breaks only inside a CUDA graph (tests/test_cuda_graph.py).

Every finding must be a failing row with the reason below (never a traceback or a pass), a saved
case that replays, and rows on disk.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Hostile:
    impl: str          # the --impl spec
    op: str
    metric: str        # gate_metric of the failing row
    says: str          # the failing row's reason contains this
    isolate: bool = False  # takes the process down, or fools any judge in its process: only isolated
    # isolated, where it differs: (metric, says) when the parent judges (the reference it looks for
    # is not in the worker)
    isolated: tuple[str, str] | None = None

    def outcome(self, isolated: bool) -> tuple[str, str]:
        return self.isolated if isolated and self.isolated else (self.metric, self.says)


CPU = [
    Hostile("tests.hostile.cpu:zeroes_kv", "sparse_prefill", "input_written", "kv: input written"),
    Hostile("tests.hostile.cpu:zeroes_q", "sparse_prefill", "input_written", "q: input written"),
    Hostile("tests.hostile.cpu:zeroes_indices", "sparse_prefill", "input_written", "indices: input written"),
    Hostile("tests.hostile.cpu:zeroes_block_table", "convert_index", "input_written", "block_table: input written"),
    Hostile("tests.hostile.cpu:zeroes_lses", "dcp_merge", "input_written", "lses: input written"),
    Hostile("tests.hostile.cpu:scribbles_kv_cache", "sparse_decode_fp8", "input_written", "kv_cache: input written"),
    Hostile("tests.hostile.cpu:writes_cache_padding", "write_fp8_ds_mla_cache", "mismatch_frac",
            "1 / 22304 elements (0.00448%) differ bit for bit; first at [1,16,655]: kernel 0, reference 255"),
    Hostile("tests.hostile.cpu:returns_input_view", "dcp_merge", "contract", "out: shares memory with input outs"),
    Hostile("tests.hostile.cpu:out_float32", "sparse_prefill", "contract", "out: dtype float32, the contract says bfloat16"),
    Hostile("tests.hostile.cpu:lse_float64", "sparse_prefill", "contract", "lse: dtype float64, the contract says float32"),
    Hostile("tests.hostile.cpu:int32_out", "sparse_prefill", "contract", "out: dtype int32, the contract says bfloat16"),
    Hostile("tests.hostile.cpu:extra_output", "sparse_decode_fp8", "contract", "returned a tuple of 3; the contract says (out, lse)"),
    Hostile("tests.hostile.cpu:returns_list", "quantize_fp8_ds_mla", "contract", "rows: a list, the contract says a torch.Tensor"),
    Hostile("tests.hostile.cpu:meta_out", "sparse_prefill", "contract", "out: on device meta, the contract says cpu"),
    Hostile("tests.hostile.cpu:strided_workspace", "gather_upconvert_fp8", "contract", "workspace: strides"),
    Hostile("tests.hostile.cpu:padded_workspace", "gather_upconvert_fp8", "contract",
            "workspace: strides (640, 1) are not contiguous"),
    Hostile("tests.hostile.cpu:system_exit", "quantize_fp8_ds_mla", "raised", "raised SystemExit: 0"),
    Hostile("tests.hostile.cpu:generator_exit", "quantize_fp8_ds_mla", "raised", "raised GeneratorExit"),
    # The process and the judge (issue 24): put back, and the case's contract failure.
    Hostile("tests.hostile.cpu:sets_default_dtype", "quantize_fp8_ds_mla", "contract",
            "changed process-wide state: torch default dtype: torch.float32 -> torch.float64"),
    Hostile("tests.hostile.cpu:sets_default_device", "quantize_fp8_ds_mla", "contract", "torch default device: cpu -> meta"),
    Hostile("tests.hostile.cpu:changes_directory", "quantize_fp8_ds_mla", "contract", "working directory:"),
    Hostile("tests.hostile.cpu:turns_off_grad", "quantize_fp8_ds_mla", "contract", "torch grad mode: True -> False"),
    Hostile("tests.hostile.cpu:sets_threads", "quantize_fp8_ds_mla", "contract", "torch threads:"),
    Hostile("tests.hostile.cpu:replaces_stdout", "quantize_fp8_ds_mla", "contract", "sys.stdout replaced"),
    Hostile("tests.hostile.cpu:patches_torch_sub", "quantize_fp8_ds_mla", "contract", "replaced torch.sub, torch.Tensor.__ne__"),
    Hostile("tests.hostile.cpu:patches_the_oracle", "quantize_fp8_ds_mla", "contract",
            "replaced mla_verify.equivalence.judge.oracle.verdict"),
    Hostile("tests.hostile.cpu:returns_a_lying_subclass", "quantize_fp8_ds_mla", "contract",
            "rows: a _Agreeable, a torch.Tensor subclass"),
    # The reference answers after the calls (in-process) or in the parent (isolated): none to find.
    Hostile("tests.hostile.cpu:returns_the_reference", "quantize_fp8_ds_mla", "mismatch_frac", "differ bit for bit"),
    Hostile("tests.hostile.cpu:writes_the_reference", "quantize_fp8_ds_mla", "mismatch_frac", "differ bit for bit"),
    Hostile("tests.hostile.cpu:raises_keyboard_interrupt", "quantize_fp8_ds_mla", "raised", "raised KeyboardInterrupt"),
    Hostile("tests.hostile.cpu:sparse_out", "quantize_fp8_ds_mla", "contract", "rows: layout sparse_coo"),
    Hostile("tests.hostile.cpu:mkldnn_out", "sparse_prefill", "contract", "lse: layout _mkldnn"),
    Hostile("tests.hostile.cpu:loosens_the_bounds", "quantize_fp8_ds_mla", "mismatch_frac", "differ bit for bit",
            isolate=True),
    Hostile("tests.hostile.cpu:aborts", "quantize_fp8_ds_mla", "crashed", "killed by SIGABRT", isolate=True),
    Hostile("tests.impls.misbehaving:segfaults", "quantize_fp8_ds_mla", "crashed", "killed by SIGSEGV", isolate=True),
    Hostile("tests.impls.misbehaving:exits", "quantize_fp8_ds_mla", "crashed", "exit code 3", isolate=True),
    Hostile("tests.impls.misbehaving:hangs", "quantize_fp8_ds_mla", "hung", "no answer within", isolate=True),
]

# Take the isolation worker's CUDA context down (or hang it): every one must fail its case, and the
# next case must run in a fresh worker, never reported hung.
CUDA = [
    Hostile("tests.hostile.cuda:assert_on_three_tokens", "sparse_prefill", "raised", "device-side assert", isolate=True),
    Hostile("tests.hostile.cuda:triton_illegal_address", "sparse_prefill", "raised", "illegal memory access", isolate=True),
    Hostile("tests.hostile.cuda:spins", "sparse_prefill", "hung", "no answer within", isolate=True),
    Hostile("tests.hostile.cuda:aborts_after_launch", "sparse_prefill", "crashed", "killed by SIGABRT", isolate=True),
    Hostile("tests.hostile.cuda:corrupts_kv_cache", "sparse_decode_fp8", "input_written", "kv_cache: input written",
            isolate=True),
    Hostile("tests.hostile.cuda:returns_on_host", "sparse_prefill", "contract", "out: on device cpu, the contract says cuda",
            isolate=True),
]

# Right eagerly, unsafe in a CUDA graph: property:cuda_graph must fail each (GPU only).
GRAPH = [
    Hostile("sparse_prefill=tests.hostile.graph:syncs_on_host", "property:cuda_graph", "raised",
            "does not capture in a CUDA graph", isolate=True),
    Hostile("sparse_decode_fp8=tests.hostile.graph:allocates_from_host", "property:cuda_graph", "raised",
            "does not capture in a CUDA graph", isolate=True),
    Hostile("sparse_decode_fp8=tests.hostile.graph:reads_sizes_on_host", "property:cuda_graph", "raised",
            "does not capture in a CUDA graph", isolate=True),
    Hostile("sparse_decode_fp8=tests.hostile.graph:keeps_state", "property:cuda_graph", "mismatch_frac",
            "differ bit for bit", isolate=True),
]

# The line between an isolation worker and its judge (issue 35): what the worker sends is data the
# parent parses, and anything else is the case's crash; isolated only (`in_process`: the outcome
# in process where the attack applies there too).
B = "tests.hostile.boundary:"
BOUNDARY = [
    Hostile(B + "returns_a_pickle_bomb", "quantize_fp8_ds_mla", "contract", "rows: a _Reduces, the contract says"),
    Hostile(B + "writes_garbage_to_its_pipe", "quantize_fp8_ds_mla", "crashed",
            "the worker sent an unreadable message: it does not start as a message does", isolate=True),
    Hostile(B + "forges_an_error", "quantize_fp8_ds_mla", "crashed",
            "the worker reported an error after the implementation was called: forged by the kernel", isolate=True),
    Hostile(B + "forges_a_failure_without_rows", "quantize_fp8_ds_mla", "missing", "the implementation returned no 'rows'",
            isolate=True),
    Hostile(B + "answers_out_of_sequence", "quantize_fp8_ds_mla", "crashed",
            "the worker sent an unreadable message: it answers request", isolate=True),
    Hostile(B + "claims_a_huge_tensor", "quantize_fp8_ds_mla", "crashed",
            "the worker sent an unreadable message: a tensor's shape [1125899906842624]", isolate=True),
    Hostile(B + "swaps_the_channels_send", "quantize_fp8_ds_mla", "contract",
            "tampered with the worker's channel to its judge: the worker's channel.send_frames", isolate=True),
    Hostile(B + "writes_after_return", "quantize_fp8_ds_mla", "contract",
            "rows: the output changed after the call returned: a write after return"),
    Hostile(B + "dies_leaving_a_child_on_the_pipe", "quantize_fp8_ds_mla", "crashed", "the worker process died (exit code 0)",
            isolate=True),
    # the shared segments (issue 41)
    Hostile(B + "claims_past_the_segment", "quantize_fp8_ds_mla", "crashed",
            "the worker sent an unreadable message: a tensor of 16 bytes at offset", isolate=True),
    Hostile(B + "claims_overlapping_outputs", "quantize_fp8_ds_mla", "crashed",
            "the worker sent an unreadable message: two tensors overlap in the shared segment", isolate=True),
    Hostile(B + "writes_its_input_and_hides_it", "quantize_fp8_ds_mla", "input_written",
            "what the judge handed over differs from its own copy", isolate=True),
]

# What lies outside the worker (issue 45): its judge's process, memory, descriptors and process
# group, the fork server, the harness's own files. Behind the sandbox each primitive is refused and
# the kernel's own wrong answer fails its case (tests/hostile/sandbox.py says why each stands for
# an exploit); with --sandbox off, as the judge's user, several pass.
S = "tests.hostile.sandbox:"
WRONG = ("mismatch_frac", "differ bit for bit")
SANDBOX = [Hostile(S + name, "quantize_fp8_ds_mla", *WRONG, isolate=True) for name in (
    "ptraces_the_judge", "reads_the_judges_memory", "reads_the_judges_memory_by_syscall", "opens_the_judges_descriptors",
    "takes_a_judges_descriptor", "signals_the_judge", "signals_the_judges_group", "asks_the_fork_server",
    "writes_the_harness", "writes_the_working_directory")] + [
    # the bounds are the run's (item 2): a deviation declared only where the worker imports it
    Hostile("tests.hostile.in_the_worker:declares_only_in_the_worker", "quantize_fp8_ds_mla", "contract",
            "the worker answered under deviation(s) bf16_cache_scale, which the run did not resolve", isolate=True),
]

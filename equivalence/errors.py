"""The harness's errors, each raised where it is found and handled where the run decides what it
means: a usage error ends the command with exit 2 and one line, a broken contract is the kernel's
finding, a harness error is mla-verify's own (exit 3, the traceback kept)."""


class UsageError(ValueError):
    """Bad command-line input: the CLI exits 2 with this one-line message."""


class ContractError(Exception):
    """The implementation broke the contract in a way that is not a value (one-line message)."""


class HarnessError(RuntimeError):
    """mla-verify itself failed (building inputs, the reference, a worker that cannot start);
    `detail` holds the traceback."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail

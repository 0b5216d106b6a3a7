//! `rootrank`: names the tensor-parallel rank that really failed a PD-disaggregation transfer.
//! The binary is a thin edge over the library's [`rootrank::main`].

use std::process::ExitCode;

fn main() -> ExitCode {
    // SAFETY: first thing in main, before any thread exists. The simulated ranks (this binary)
    // run NIXL over UCX; the library never sets the environment itself.
    #[cfg(feature = "nixl")]
    unsafe {
        rootrank_transfer_agent::set_ucx_defaults_before_threads()
    };
    ExitCode::from(rootrank::main(std::env::args_os()))
}

//! Which fatal errors mean "a peer of my collective vanished" (SPEC section 5, rule 7).
//!
//! When one rank of a group is SIGKILLed, its siblings do not wait: they are inside the next
//! collective (SGLang all-reduces its poll states every scheduler iteration), the library
//! raises tens of milliseconds later, and each sibling dies of that exception long before the
//! killed rank's lease expires. Such a death is a *victim*: `peer_lost`, never blamed while
//! the rank it lost can still show up. The SGLang plugin and `rootrank run` classify a fatal
//! traceback with [`classify_fatal`]; one table serves both.
//!
//! Every row is a text the real library raises, collected here, not from memory: gloo's from
//! torch 2.14.1 (a 2- and a 4-rank gloo group on loopback, one rank SIGKILLed mid
//! all-reduce); NCCL's and torch c10d's from the strings of `libnccl.so.2` (nvidia-nccl-cu13)
//! and `libtorch_cuda.so`/`libtorch_cpu.so` of the same wheels (no GPU here to raise them).
//! A text that merely mentions a peer (a Python socket's `Connection reset by peer`, a port
//! already in use) is no lost collective and stays `python_exception`.

use crate::ids::reasons;

/// (needles that must all be in the exception's line, lower-cased; where the text comes from)
const PEER_LOST: &[(&[&str], &str)] = &[
    (
        &["gloo", "connection closed by peer"],
        "gloo tcp pair.cc: the peer's socket closed",
    ),
    (
        &["gloo", "connection reset by peer"],
        "gloo tcp pair.cc: read error, reset by the peer",
    ),
    (&["ncclremoteerror"], "NCCL: a remote process exited prematurely"),
    (
        &["remote process exited or there was a network error"],
        "NCCL: ncclRemoteError's text",
    ),
    (
        &["nccl communicator was aborted"],
        "torch ProcessGroupNCCL: the communicator aborted",
    ),
    (
        &["failed to recv, got 0 bytes"],
        "torch c10d tcputil: the store's peer closed",
    ),
    (
        &["distnetworkerror", "connection reset by peer"],
        "torch c10d: DistNetworkError from a peer",
    ),
    (
        &["distnetworkerror", "connection closed by peer"],
        "torch c10d: DistNetworkError from a peer",
    ),
];

/// `peer_lost` when a fatal traceback's exception is a lost collective, else
/// `python_exception`.
pub fn classify_fatal(traceback: &str) -> &'static str {
    if is_peer_lost(traceback) {
        reasons::PEER_LOST
    } else {
        reasons::PYTHON_EXCEPTION
    }
}

/// Whether the exception that ended a traceback (its last `Type: message` line, or the last
/// line when there is none) says a peer of the collective vanished.
pub fn is_peer_lost(traceback: &str) -> bool {
    let line = exception_line(traceback).to_lowercase();
    PEER_LOST
        .iter()
        .any(|(needles, _)| needles.iter().all(|n| line.contains(n)))
}

/// The line that names the exception which ended a Python traceback: the last line that
/// starts with a dotted name followed by `:` (`RuntimeError: ...`,
/// `torch.distributed.DistNetworkError: ...`). Frames and source lines are indented.
pub fn exception_line(traceback: &str) -> &str {
    let lines = || traceback.lines().rev().filter(|l| !l.trim().is_empty());
    let named = lines().find(|l| {
        let Some((name, _)) = l.split_once(':') else {
            return false;
        };
        !name.is_empty()
            && !l.starts_with(char::is_whitespace)
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
    });
    named.or_else(|| lines().next()).unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real texts, one per row: what the library raised (or holds in its binary).
    #[test]
    fn the_real_texts_of_a_lost_collective_are_peer_lost() {
        let cases = [
            // torch 2.14.1 gloo, the survivor of a 2-rank group (its peer SIGKILLed), raised here.
            "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:4997: Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. Check the logs of the remote worker before reporting an error. GLHF!",
            // The same, in a 4-rank group.
            "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:18661. This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF!",
            // torch.distributed over NCCL: the texts libtorch_cuda.so and libnccl.so.2 carry.
            "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3690, remote process exited or there was a network error, NCCL version 2.27.7",
            "RuntimeError: ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
            "torch.distributed.DistBackendError: NCCL communicator was aborted on rank 1.",
            // c10d's TCPStore client when the store's process is gone.
            "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?",
        ];
        for text in cases {
            assert_eq!(classify_fatal(text), reasons::PEER_LOST, "{text}");
        }
    }

    #[test]
    fn a_text_that_only_mentions_a_peer_stays_python_exception() {
        let cases = [
            // A Python socket (the bootstrap server, zmq, requests), no collective.
            "ConnectionResetError: [Errno 104] Connection reset by peer",
            "requests.exceptions.ConnectionError: ('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))",
            // c10d at start-up: a port in use is a configuration error, not a lost peer.
            "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
            "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error",
            "ValueError: gloo backend requires a CPU tensor",
            "",
        ];
        for text in cases {
            assert_eq!(classify_fatal(text), reasons::PYTHON_EXCEPTION, "{text}");
        }
    }

    #[test]
    fn the_exception_line_of_a_traceback_decides() {
        let tb = "Traceback (most recent call last):\n  File \"/sglang/srt/managers/scheduler.py\", line 6330, in run_scheduler_process\n    scheduler.run_event_loop()\n  File \"/sglang/srt/disaggregation/utils.py\", line 302, in _all_reduce_polls\n    return all_reduce_flags(flags=polls, group=group, op=dist.ReduceOp.MIN)\nRuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:8355. This is typically caused by a remote worker crashing.\n";
        assert!(exception_line(tb).starts_with("RuntimeError: [/__w/pytorch"));
        assert_eq!(classify_fatal(tb), reasons::PEER_LOST);
        // A peer-lost text in a frame's source line, not in the exception, decides nothing.
        let tb = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n    log('gloo Connection closed by peer')\nKeyError: 'room'\n";
        assert_eq!(classify_fatal(tb), reasons::PYTHON_EXCEPTION);
    }
}

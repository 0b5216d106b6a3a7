//! Bounded tail of a child's output, for a supervisor that passes the
//! child's stderr through and attaches the last lines to its certificate.

use std::collections::VecDeque;

/// Default number of lines kept.
pub const DEFAULT_LINES: usize = 50;
/// Default cap on one line, in bytes; longer lines are cut (a runaway
/// progress bar must not make the tail huge).
pub const DEFAULT_LINE_BYTES: usize = 512;

/// The last `max_lines` lines, each at most `max_line_bytes` bytes of
/// (lossy) UTF-8. Feed it raw chunks as they are read; partial lines are
/// held until their newline or [`LogTail::finish`].
#[derive(Debug, Clone)]
pub struct LogTail {
    lines: VecDeque<String>,
    max_lines: usize,
    max_line_bytes: usize,
    /// Bytes of the current unfinished line (capped; the excess is dropped).
    partial: Vec<u8>,
    total_lines: u64,
}

impl Default for LogTail {
    fn default() -> Self {
        Self::new(DEFAULT_LINES, DEFAULT_LINE_BYTES)
    }
}

impl LogTail {
    /// A tail keeping `max_lines` lines of at most `max_line_bytes` bytes
    /// (both at least 1).
    pub fn new(max_lines: usize, max_line_bytes: usize) -> Self {
        LogTail {
            lines: VecDeque::new(),
            max_lines: max_lines.max(1),
            max_line_bytes: max_line_bytes.max(1),
            partial: Vec::new(),
            total_lines: 0,
        }
    }

    /// Feeds a chunk of output (any split, any bytes).
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut rest = chunk;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            let (line, tail) = rest.split_at(pos);
            self.append_partial(line);
            self.end_line();
            rest = tail.get(1..).unwrap_or(&[]);
        }
        self.append_partial(rest);
    }

    /// Adds one complete line (without its newline).
    pub fn push_line(&mut self, line: &[u8]) {
        self.flush_partial();
        self.append_partial(line);
        self.end_line();
    }

    /// Ends the stream: a trailing line without newline is kept.
    pub fn finish(&mut self) {
        self.flush_partial();
    }

    fn flush_partial(&mut self) {
        if !self.partial.is_empty() {
            self.end_line();
        }
    }

    fn append_partial(&mut self, bytes: &[u8]) {
        // Keep up to 3 extra bytes so a multi-byte character at the cap is
        // not split before the lossy conversion.
        let room = self.max_line_bytes.saturating_add(3).saturating_sub(self.partial.len());
        self.partial
            .extend_from_slice(bytes.get(..room.min(bytes.len())).unwrap_or(&[]));
    }

    fn end_line(&mut self) {
        let raw = std::mem::take(&mut self.partial);
        let mut line = String::from_utf8_lossy(&raw).into_owned();
        if line.ends_with('\r') {
            line.pop();
        }
        if line.len() > self.max_line_bytes {
            let mut cut = self.max_line_bytes;
            while !line.is_char_boundary(cut) {
                cut -= 1;
            }
            line.truncate(cut);
        }
        self.lines.push_back(line);
        self.total_lines += 1;
        while self.lines.len() > self.max_lines {
            self.lines.pop_front();
        }
    }

    /// The kept lines, oldest first.
    pub fn lines(&self) -> impl Iterator<Item = &str> {
        self.lines.iter().map(String::as_str)
    }

    /// The kept lines joined with `\n`.
    pub fn text(&self) -> String {
        self.lines().collect::<Vec<_>>().join("\n")
    }

    pub fn len(&self) -> usize {
        self.lines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// Lines seen in total, including those no longer kept.
    pub fn total_lines(&self) -> u64 {
        self.total_lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_last_n_lines_across_chunk_splits() {
        let mut t = LogTail::new(3, 512);
        t.feed(b"one\ntw");
        t.feed(b"o\nthree\nfour\nfi");
        t.finish();
        assert_eq!(t.lines().collect::<Vec<_>>(), ["three", "four", "fi"]);
        assert_eq!(t.total_lines(), 5);
    }

    #[test]
    fn caps_line_length_on_a_char_boundary() {
        let mut t = LogTail::new(5, 4);
        t.feed("abcdefgh\n".as_bytes());
        t.feed("ab\u{e9}\u{e9}\n".as_bytes()); // é is 2 bytes: "abé" = 4 bytes
        t.feed(&[b'x'; 10_000]);
        t.feed(b"\n");
        assert_eq!(t.lines().collect::<Vec<_>>(), ["abcd", "ab\u{e9}", "xxxx"]);
    }

    #[test]
    fn invalid_utf8_and_crlf() {
        let mut t = LogTail::default();
        t.feed(b"bad \xff\xfe bytes\r\n");
        t.push_line(b"direct");
        assert_eq!(t.text(), "bad \u{fffd}\u{fffd} bytes\ndirect");
    }

    #[test]
    fn empty_stream() {
        let mut t = LogTail::default();
        t.finish();
        assert!(t.is_empty());
    }
}

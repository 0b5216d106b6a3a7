//! RFC 3339 timestamps with millisecond precision, as stored in records' `at` fields.
//!
//! The core never reads a clock: the shells pass Unix milliseconds in, and these helpers
//! convert them to and from text. Kept here (not chrono) because the core needs only this.

/// Formats Unix milliseconds as `2026-12-02T15:04:05.123Z`. Written digit by digit: every
/// verdict formats one stamp per piece of evidence, and `format!` was a tenth of its cost.
pub fn format_ms(unix_ms: i64) -> String {
    let secs = unix_ms.div_euclid(1000);
    let ms = unix_ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    if !(0..=9999).contains(&y) {
        // Outside four-digit years (never a real record): the slow, general path.
        return format!(
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z",
            sod / 3600,
            (sod / 60) % 60,
            sod % 60
        );
    }
    let mut b = *b"0000-00-00T00:00:00.000Z";
    let mut put = |at: usize, width: usize, mut v: i64| {
        for i in (0..width).rev() {
            b[at + i] = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(0, 4, y);
    put(5, 2, m);
    put(8, 2, d);
    put(11, 2, sod / 3600);
    put(14, 2, (sod / 60) % 60);
    put(17, 2, sod % 60);
    put(20, 3, ms);
    // Only ASCII digits and separators were written.
    String::from_utf8_lossy(&b).into_owned()
}

/// Parses an RFC 3339 timestamp (`Z` or `±HH:MM` offset, optional fraction) into Unix
/// milliseconds. Returns `None` for anything else; callers fall back to the observed time.
pub fn parse_ms(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |from: usize, to: usize| -> Option<i64> {
        let s = text.get(from..to)?;
        if !s.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let (y, mo, d) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    let (h, mi, s) = (num(11, 13)?, num(14, 16)?, num(17, 19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let mut i = 19;
    let mut ms = 0i64;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            if i - start < 3 {
                ms = ms * 10 + i64::from(b[i] - b'0');
            }
            i += 1;
        }
        if i == start {
            return None;
        }
        for _ in (i - start)..3 {
            ms *= 10;
        }
    }
    let offset_min = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if i + 6 == b.len() && b[i + 3] == b':' => {
            let oh = num(i + 1, i + 3)?;
            let om = num(i + 4, i + 6)?;
            let off = oh * 60 + om;
            if *sign == b'-' {
                -off
            } else {
                off
            }
        }
        _ => return None,
    };
    let days = days_from_civil(y, mo, d);
    let secs = days * 86_400 + h * 3600 + mi * 60 + s - offset_min * 60;
    Some(secs * 1000 + ms)
}

// Howard Hinnant's civil calendar algorithms (public domain), proleptic Gregorian.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_known_instants() {
        assert_eq!(format_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_ms(1_796_224_805_123), "2026-12-02T15:20:05.123Z");
        assert_eq!(parse_ms("2026-12-02T15:20:05.123Z"), Some(1_796_224_805_123));
        assert_eq!(parse_ms("2026-12-02T16:20:05.123+01:00"), Some(1_796_224_805_123));
        assert_eq!(parse_ms("2026-12-02T15:20:05Z"), Some(1_796_224_805_000));
        assert_eq!(parse_ms("2026-12-02T15:20:05.123456Z"), Some(1_796_224_805_123));
        assert_eq!(
            parse_ms("2024-02-29T00:00:00.000Z").map(format_ms).as_deref(),
            Some("2024-02-29T00:00:00.000Z")
        );
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "yesterday",
            "2026-13-02T15:20:05Z",
            "2026-12-02T15:20:05",
            "2026-12-02T15:20:05.Z",
            "2026-12-02T15:20:05Zjunk",
            "２０２６-12-02T15:20:05Z",
        ] {
            assert_eq!(parse_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn every_millisecond_of_a_range_round_trips() {
        for ms in (-10_000_000_000i64..10_000_000_000_000).step_by(7_777_777_777) {
            assert_eq!(parse_ms(&format_ms(ms)), Some(ms));
        }
    }
}

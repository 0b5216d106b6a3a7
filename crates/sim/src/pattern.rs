//! The bytes a prefill rank sends for (room, rank, chunk), so decode can check them without
//! any side channel: a splitmix64 stream seeded by the three.

/// One splitmix64 step (a good 64-bit mixer).
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn seed(room: u64, rank: u32, chunk: u32) -> u64 {
    splitmix64(room ^ (u64::from(rank) << 48) ^ (u64::from(chunk) << 32).rotate_left(7))
}

/// Fills `buf` with the pattern of (room, rank, chunk).
pub fn fill(buf: &mut [u8], room: u64, rank: u32, chunk: u32) {
    let s = seed(room, rank, chunk);
    for (i, word) in buf.chunks_mut(8).enumerate() {
        let v = splitmix64(s.wrapping_add(i as u64)).to_le_bytes();
        word.copy_from_slice(&v[..word.len()]);
    }
}

/// Whether `buf` holds the pattern of (room, rank, chunk).
pub fn check(buf: &[u8], room: u64, rank: u32, chunk: u32) -> bool {
    let s = seed(room, rank, chunk);
    buf.chunks(8).enumerate().all(|(i, word)| {
        let v = splitmix64(s.wrapping_add(i as u64)).to_le_bytes();
        word == &v[..word.len()]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check_and_detects_differences() {
        let mut b = vec![0u8; 1001];
        fill(&mut b, 42, 3, 1);
        assert!(check(&b, 42, 3, 1));
        assert!(!check(&b, 42, 3, 0));
        assert!(!check(&b, 43, 3, 1));
        assert!(!check(&b, 42, 2, 1));
        b[1000] ^= 1;
        assert!(!check(&b, 42, 3, 1));
    }
}

//! A 64-bit content fingerprint (FNV-1a) that ties token files and checkpoints to the texts and
//! the tokenizer they came from. Stable across platforms and releases (unlike `std`'s hasher,
//! whose output may change), so a cache written by one build is recognized by the next. Not a
//! cryptographic hash: it detects accidental mismatches, not forgeries.

const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a over a sequence of byte chunks fed one after another.
#[derive(Clone, Copy, Debug)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Fnv64(OFFSET)
    }
}

impl Fnv64 {
    pub fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(PRIME);
        }
    }

    /// Feeds `bytes` preceded by their length, so that chunk boundaries count: ("ab", "c") and
    /// ("a", "bc") differ.
    pub fn update_framed(&mut self, bytes: &[u8]) {
        self.update(&(bytes.len() as u64).to_le_bytes());
        self.update(bytes);
    }

    pub fn finish(self) -> u64 {
        self.0
    }
}

/// FNV-1a 64 of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = Fnv64::default();
    h.update(bytes);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_published_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn framing_separates_chunks() {
        let mut a = Fnv64::default();
        a.update_framed(b"ab");
        a.update_framed(b"c");
        let mut b = Fnv64::default();
        b.update_framed(b"a");
        b.update_framed(b"bc");
        assert_ne!(a.finish(), b.finish());
    }
}

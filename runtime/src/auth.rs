//! What the runtime's shared-secret handshakes are built from: HMAC-SHA256 proofs,
//! constant-time equality and hex. The ring's links (`collective/link.rs`) and the data
//! channel (`channel/handshake.rs`) prove knowledge of a secret with [`proof`]; the join
//! token and the CA hash (`tls.rs`) use the rest.

use sha2::{Digest, Sha256};

/// HMAC-SHA256 under `key` over `parts`, each length-prefixed (`u32` LE), so that no
/// two different lists of parts make the same message. The first part should name the
/// protocol and the role of the side that proves, so that no proof serves another.
pub(crate) fn proof(key: &[u8; 32], parts: &[&[u8]]) -> [u8; 32] {
    let mut message = Vec::with_capacity(parts.iter().map(|part| 4 + part.len()).sum());
    for part in parts {
        message.extend_from_slice(&(part.len() as u32).to_le_bytes());
        message.extend_from_slice(part);
    }
    hmac_sha256(key, &message)
}

/// HMAC-SHA256 (RFC 2104).
pub(crate) fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut block_key = [0u8; BLOCK];
    if key.len() > BLOCK {
        block_key[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block_key[..key.len()].copy_from_slice(key);
    }
    let inner = Sha256::new()
        .chain_update(block_key.map(|b| b ^ 0x36))
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(block_key.map(|b| b ^ 0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

/// Equality of two byte strings in time that depends on their length only: no early exit
/// at the first difference, so timing does not reveal how much of a guess was right.
/// (`subtle` would do the same; this is all we need of it.)
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        // `black_box` keeps the optimiser from turning the loop back into an early exit.
        diff |= std::hint::black_box(x ^ y);
    }
    diff == 0
}

/// Lower-case hex.
pub(crate) fn encode_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Hex of either case; `None` for an odd length or a character that is not a hex digit.
pub(crate) fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    // `from_str_radix` alone would take a sign.
    if !hex.len().is_multiple_of(2) || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(hex.get(at..at + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test cases 1, 2 and 6 (a key longer than the block).
        let cases: [(&[u8], &[u8], &str); 3] = [
            (
                &[0x0b; 20],
                b"Hi There",
                "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
            ),
            (
                b"Jefe",
                b"what do ya want for nothing?",
                "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
            ),
            (
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First",
                "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
            ),
        ];
        for (key, message, expected) in cases {
            assert_eq!(encode_hex(&hmac_sha256(key, message)), expected);
        }
    }

    #[test]
    fn proofs_depend_on_every_part_and_its_boundaries() {
        let key = [7; 32];
        let base = proof(&key, &[b"role", b"ab", b"c"]);
        for other in [
            proof(&key, &[b"role", b"a", b"bc"]),
            proof(&key, &[b"role", b"abc"]),
            proof(&key, &[b"rolf", b"ab", b"c"]),
            proof(&[8; 32], &[b"role", b"ab", b"c"]),
        ] {
            assert_ne!(base, other);
        }
        assert_eq!(base, proof(&key, &[b"role", b"ab", b"c"]));
    }

    #[test]
    fn constant_time_eq_is_equality() {
        let cases: [(&[u8], &[u8], bool); 6] = [
            (b"", b"", true),
            (b"a", b"a", true),
            (b"abc", b"abd", false),
            (b"abc", b"ab", false),
            (b"", b"a", false),
            (b"xbc", b"abc", false),
        ];
        for (a, b, equal) in cases {
            assert_eq!(constant_time_eq(a, b), equal, "{a:?} {b:?}");
        }
    }

    #[test]
    fn hex_round_trips_and_refuses_non_hex() {
        let bytes = [0x00, 0x7f, 0x80, 0xff];
        assert_eq!(encode_hex(&bytes), "007f80ff");
        assert_eq!(decode_hex("007F80ff").as_deref(), Some(&bytes[..]));
        for bad in ["0", "0g", "+1", " 01", "é1"] {
            assert_eq!(decode_hex(bad), None, "{bad:?}");
        }
    }
}

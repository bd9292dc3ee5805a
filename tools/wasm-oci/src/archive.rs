//! Deterministic archives: a POSIX ustar writer (the OCI layout as one file, and the compat
//! variant's layer) and a gzip writer with stored deflate blocks (the compat layer's
//! `tar+gzip`: valid gzip that any reader inflates, bytes fixed by the input alone).
//!
//! Every entry has mtime 0, uid/gid 0, no user or group names, mode 0644 (files) or 0755
//! (directories): the same input always gives the same bytes, hence the same digests.

/// One archive entry: a directory (`None`) or a file with its bytes. Paths use `/` and
/// directories end with `/`.
pub type Entry<'a> = (&'a str, Option<&'a [u8]>);

const BLOCK: usize = 512;

/// A ustar archive of `entries`, in the order given. Names must fit the 100-byte name field
/// (the layout's longest, `blobs/sha256/<64 hex>`, is 77).
pub fn tar(entries: &[Entry<'_>]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    for (name, data) in entries {
        if name.len() > 100 || name.is_empty() || !name.is_ascii() {
            return Err(format!(
                "tar entry name {name:?} does not fit a ustar header"
            ));
        }
        let mut h = [0u8; BLOCK];
        h[..name.len()].copy_from_slice(name.as_bytes());
        let (mode, size, kind) = match data {
            Some(d) => (0o644, d.len(), b'0'),
            None => (0o755, 0, b'5'),
        };
        octal(&mut h[100..108], mode as u64); // mode
        octal(&mut h[108..116], 0); // uid
        octal(&mut h[116..124], 0); // gid
        octal(&mut h[124..136], size as u64); // size
        octal(&mut h[136..148], 0); // mtime
        h[148..156].fill(b' '); // checksum, counted as spaces
        h[156] = kind;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        octal(&mut h[329..337], 0); // devmajor
        octal(&mut h[337..345], 0); // devminor
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        let digits = format!("{sum:06o}\0 ");
        h[148..156].copy_from_slice(digits.as_bytes());
        out.extend_from_slice(&h);
        if let Some(d) = data {
            out.extend_from_slice(d);
            out.resize(out.len().div_ceil(BLOCK) * BLOCK, 0);
        }
    }
    // End of archive: two zero blocks.
    out.resize(out.len() + 2 * BLOCK, 0);
    Ok(out)
}

/// `value` as zero-padded octal digits filling `field` but its last byte (a NUL).
fn octal(field: &mut [u8], value: u64) {
    let width = field.len() - 1;
    let s = format!("{value:0width$o}");
    field[..width].copy_from_slice(&s.as_bytes()[s.len() - width..]);
    field[width] = 0;
}

/// `data` as a gzip member of stored (uncompressed) deflate blocks, header mtime 0.
pub fn gzip_stored(data: &[u8]) -> Vec<u8> {
    // ID1 ID2, CM=deflate, FLG=0, MTIME=0, XFL=0, OS=255 (unknown)
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255];
    let mut chunks = data.chunks(u16::MAX as usize).peekable();
    if chunks.peek().is_none() {
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    }
    while let Some(chunk) = chunks.next() {
        let last = chunks.peek().is_none();
        // BFINAL in bit 0, BTYPE=00 (stored); the rest of the byte pads to a boundary.
        out.push(u8::from(last));
        let len = chunk.len() as u16;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(chunk);
    }
    out.extend_from_slice(&crc32(data).to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out
}

/// CRC-32 (IEEE 802.3, reflected, as gzip uses).
fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn tar_headers_have_valid_checksums_and_padding() {
        let t = tar(&[("d/", None), ("d/f", Some(b"hello"))]).unwrap();
        assert_eq!(t.len(), 512 + 512 + 512 + 1024);
        for h in [&t[..512], &t[512..1024]] {
            let stored = std::str::from_utf8(&h[148..154]).unwrap();
            let mut copy = h.to_vec();
            copy[148..156].fill(b' ');
            let sum: u32 = copy.iter().map(|&b| u32::from(b)).sum();
            assert_eq!(u32::from_str_radix(stored, 8).unwrap(), sum);
        }
        assert_eq!(&t[1024..1029], b"hello");
        assert_eq!(&t[124..135], b"00000000000");
        assert_eq!(&t[512 + 124..512 + 135], b"00000000005");
    }

    #[test]
    fn a_name_too_long_for_ustar_is_refused() {
        let long = "x".repeat(101);
        assert!(tar(&[(long.as_str(), Some(b""))]).is_err());
    }

    #[test]
    fn gzip_stored_frames_blocks_of_at_most_64k() {
        let data = vec![7u8; 70_000];
        let gz = gzip_stored(&data);
        // header + 2 blocks (5 bytes of framing each) + data + crc + size
        assert_eq!(gz.len(), 10 + 5 + 5 + data.len() + 8);
        assert_eq!(gz[10], 0); // first block not final
        assert_eq!(gz[10 + 5 + 65_535], 1); // second block final
        assert_eq!(gzip_stored(b"").len(), 10 + 5 + 8);
    }
}

//! Buffers handed over by address, as the Python binding hands tensors' storage: the checks
//! that make viewing them as slices sound.

use crate::error::{Error, Result};

/// A buffer: its name (for messages), first byte, length in bytes and the alignment its
/// element type needs.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    pub name: &'static str,
    pub addr: usize,
    pub bytes: usize,
    pub align: usize,
}

impl Span {
    fn end(&self) -> usize {
        self.addr.saturating_add(self.bytes)
    }
}

/// Every span non-null (unless empty) and aligned; every written span overlapping no other
/// span, written or read (a step would otherwise read what it is writing).
pub fn check_spans(written: &[Span], read: &[Span]) -> Result<()> {
    for s in written.iter().chain(read) {
        if s.bytes > 0 && (s.addr == 0 || s.addr % s.align != 0) {
            return Err(Error::Invalid(format!(
                "host optimizer: the {} buffer at {:#x} is null or not aligned to {} bytes",
                s.name, s.addr, s.align
            )));
        }
    }
    for (i, w) in written.iter().enumerate() {
        for other in written[i + 1..].iter().chain(read) {
            let overlap =
                w.bytes > 0 && other.bytes > 0 && w.addr < other.end() && other.addr < w.end();
            if overlap {
                return Err(Error::Invalid(format!(
                    "host optimizer: the {} buffer overlaps the {} buffer; give each its own memory",
                    w.name, other.name
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &'static str, addr: usize, bytes: usize) -> Span {
        Span {
            name,
            addr,
            bytes,
            align: 4,
        }
    }

    #[test]
    fn overlaps_and_alignment() {
        let p = span("params", 0x1000, 64);
        assert!(check_spans(
            &[p, span("exp_avg", 0x1040, 64)],
            &[span("grads", 0x2000, 64)]
        )
        .is_ok());
        let err = check_spans(&[p], &[span("grads", 0x103c, 8)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("params buffer overlaps the grads"), "{err}");
        assert!(check_spans(&[p, span("exp_avg", 0x1000, 4)], &[]).is_err());
        assert!(check_spans(&[span("params", 0x1002, 8)], &[]).is_err());
        assert!(check_spans(&[span("params", 0, 8)], &[]).is_err());
        // Empty buffers overlap nothing, wherever they point.
        assert!(check_spans(&[p, span("copy", 0x1000, 0)], &[]).is_ok());
        // Two read buffers may be one.
        assert!(check_spans(&[p], &[span("a", 0x2000, 8), span("b", 0x2000, 8)]).is_ok());
    }
}

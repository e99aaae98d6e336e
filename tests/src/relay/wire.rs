//! Kafka's primitive types on the wire, as far as the relay's answers need them: read from the
//! front of a request, written into a response. "Flexible" versions (KIP-482) write lengths as
//! unsigned varints of length + 1 (0: null) and carry tagged fields; older ones write `i16`
//! string and `i32` array lengths (-1: null).

/// An array's length: an `i32` before flexible versions, an unsigned varint of length + 1 in
/// them (the arrays written here are never null).
pub fn array_len(w: &mut Vec<u8>, len: usize, flexible: bool) {
    if flexible {
        uvarint(w, len as u64 + 1);
    } else {
        w.extend((len as i32).to_be_bytes());
    }
}

/// A string (never null here): an `i16` length before flexible versions, an unsigned varint of
/// length + 1 in them.
pub fn string(w: &mut Vec<u8>, text: &str, flexible: bool) {
    if flexible {
        uvarint(w, text.len() as u64 + 1);
    } else {
        w.extend((text.len() as i16).to_be_bytes());
    }
    w.extend(text.as_bytes());
}

/// A null string.
pub fn null_string(w: &mut Vec<u8>, flexible: bool) {
    if flexible {
        w.push(0);
    } else {
        w.extend((-1i16).to_be_bytes());
    }
}

pub fn uvarint(w: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        w.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    w.push(n as u8);
}

/// Reads Kafka's primitive types from the front of a request.
pub struct Reader<'a>(pub &'a [u8]);

impl<'a> Reader<'a> {
    /// A request's header (API key, version, correlation id, client id, and the tagged fields
    /// of header v2 when `flexible(version)`): its key, version and correlation id.
    pub fn header(&mut self, flexible: impl Fn(i16) -> bool) -> Option<(i16, i16, i32)> {
        let (key, version, correlation_id) = (self.i16()?, self.i16()?, self.i32()?);
        self.legacy_string()?; // client id: never compact, not even in header v2
        if flexible(version) {
            self.tags()?;
        }
        Some((key, version, correlation_id))
    }

    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    pub fn i16(&mut self) -> Option<i16> {
        Some(i16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }

    pub fn i32(&mut self) -> Option<i32> {
        Some(i32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    pub fn uvarint(&mut self) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.take(1)?[0];
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }

    /// A nullable string with an `i16` length (-1: null).
    pub fn legacy_string(&mut self) -> Option<Option<String>> {
        let len = self.i16()?;
        self.text(usize::try_from(len).ok())
    }

    /// A nullable string: compact (varint length + 1, 0: null) in flexible versions.
    pub fn string(&mut self, flexible: bool) -> Option<Option<String>> {
        if !flexible {
            return self.legacy_string();
        }
        let len = self.uvarint()?;
        self.text(len.checked_sub(1).map(|n| n as usize))
    }

    fn text(&mut self, len: Option<usize>) -> Option<Option<String>> {
        match len {
            None => Some(None),
            Some(n) => Some(Some(String::from_utf8_lossy(self.take(n)?).into_owned())),
        }
    }

    /// Skips nullable bytes (a record batch): an `i32` length, or a varint of length + 1.
    pub fn skip_bytes(&mut self, flexible: bool) -> Option<()> {
        let len = if flexible {
            self.uvarint()?.checked_sub(1)
        } else {
            u64::try_from(self.i32()?).ok()
        };
        if let Some(n) = len {
            self.take(usize::try_from(n).ok()?)?;
        }
        Some(())
    }

    /// An array's length: compact (varint length + 1) in flexible versions; null reads as empty.
    pub fn array_len(&mut self, flexible: bool) -> Option<usize> {
        if flexible {
            Some(self.uvarint()?.saturating_sub(1) as usize)
        } else {
            Some(usize::try_from(self.i32()?).unwrap_or(0))
        }
    }

    /// Skips a block of tagged fields (a count, then each tag's number, size and bytes).
    pub fn tags(&mut self) -> Option<()> {
        for _ in 0..self.uvarint()? {
            self.uvarint()?;
            let size = self.uvarint()?;
            self.take(usize::try_from(size).ok()?)?;
        }
        Some(())
    }
}

/// A response frame's start: the 4-byte length (filled in by [`finish`]), the correlation id,
/// and in flexible versions header v1's (empty) tagged fields.
pub fn response(correlation_id: i32, flexible: bool) -> Vec<u8> {
    let mut w = vec![0; 4];
    w.extend(correlation_id.to_be_bytes());
    if flexible {
        w.push(0);
    }
    w
}

/// Writes the frame's length into its first four bytes.
pub fn finish(mut w: Vec<u8>) -> Vec<u8> {
    let size = (w.len() - 4) as i32;
    w[..4].copy_from_slice(&size.to_be_bytes());
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_past_one_byte_read_back() {
        for n in [0u64, 1, 127, 128, 300, 16_384, u32::MAX as u64] {
            let mut w = Vec::new();
            uvarint(&mut w, n);
            assert_eq!(Reader(&w).uvarint(), Some(n));
        }
    }
}

//! Text files, read in blocks: documents are separated by
//! [`DOC_SEPARATOR`](crate::data::build::DOC_SEPARATOR), one newline at each end of a
//! document is dropped, and empty documents are dropped (the rules of
//! [`split_documents`](crate::data::build::split_documents)).
//!
//! A document longer than `max_piece` bytes is handed on in pieces, each cut right after a
//! newline that sits between two visible ASCII characters (the cut of
//! [`chunk_document`](crate::data::build::chunk_document)), so a text file of any size is read
//! with a buffer of about `max_piece` plus one read block — when the document has such
//! newlines; one without them is held whole. The cut is never closer than a separator's length
//! to the end of what has been read, so the rest of the document is known to be non-empty
//! (the last piece alone drops the final newline).

use super::Read as Stats;
use super::{open_stream, read_error, Piece, ReadContext, Source};
use crate::data::build::DOC_SEPARATOR;
use crate::data::error::{DataError, Result};
use std::io::Read;

/// Bytes read from the file at a time.
const BLOCK: usize = 1 << 16;

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(p) = hay[i..].iter().position(|&b| b == needle[0]) {
        if hay[i + p..].starts_with(needle) {
            return Some(i + p);
        }
        i += p + 1;
    }
    None
}

/// The last cut point `c` in `b[from..=limit]`: `b[c - 1]` is a newline between two visible
/// ASCII characters (`b[c - 2]` and `b[c]`).
fn last_cut(b: &[u8], from: usize, limit: usize) -> Option<usize> {
    (from.max(2)..=limit.min(b.len().saturating_sub(1)))
        .rev()
        .find(|&c| b[c - 1] == b'\n' && b[c - 2].is_ascii_graphic() && b[c].is_ascii_graphic())
}

struct Doc<'a, 's> {
    src: &'a Source,
    cx: &'a mut ReadContext<'s>,
    /// The current document has handed on pieces already.
    started: bool,
    docs: u64,
}

impl Doc<'_, '_> {
    /// Hands on `bytes` (starting at file offset `offset`) as a piece of the current document.
    fn piece(&mut self, mut bytes: &[u8], mut offset: u64, last: bool) -> Result<()> {
        let first = !self.started;
        if first && bytes.first() == Some(&b'\n') {
            bytes = &bytes[1..];
            offset += 1;
        }
        if last && bytes.last() == Some(&b'\n') {
            bytes = &bytes[..bytes.len() - 1];
        }
        if first && last && bytes.is_empty() {
            return Ok(());
        }
        let text = std::str::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
            path: self.src.path.clone(),
            offset: offset + e.valid_up_to() as u64,
        })?;
        (self.cx.sink)(Piece { text, first, last })?;
        self.started = !last;
        if last {
            self.docs += 1;
        }
        Ok(())
    }
}

/// Reads the documents of a text source.
pub fn read(src: &Source, cx: &mut ReadContext<'_>) -> Result<Stats> {
    let mut r = open_stream(src, cx.bytes_read.clone())?;
    let max_piece = cx.max_piece;
    let mut d = Doc {
        src,
        cx,
        started: false,
        docs: 0,
    };
    let sep = DOC_SEPARATOR.as_bytes();
    // The unread part of the current document, which starts at file offset `offset`.
    let mut buf: Vec<u8> = Vec::with_capacity(max_piece + 2 * BLOCK);
    let mut offset = 0u64;
    // No separator starts before `scan` in `buf`.
    let mut scan = 0usize;
    // No cut point lies before `uncut` in `buf` (so a long document is searched once).
    let mut uncut = 0usize;
    let mut eof = false;
    loop {
        if let Some(i) = find(&buf[scan..], sep).map(|i| i + scan) {
            d.piece(&buf[..i], offset, true)?;
            buf.drain(..i + sep.len());
            offset += (i + sep.len()) as u64;
            scan = 0;
            uncut = 0;
            continue;
        }
        scan = buf.len().saturating_sub(sep.len() - 1);
        if eof {
            d.piece(&buf, offset, true)?;
            offset += buf.len() as u64;
            break;
        }
        if max_piece > 0 && buf.len() >= max_piece {
            let limit = buf.len().saturating_sub(sep.len());
            match last_cut(&buf, uncut, limit) {
                Some(c) => {
                    d.piece(&buf[..c], offset, false)?;
                    buf.drain(..c);
                    offset += c as u64;
                    scan = scan.saturating_sub(c);
                    uncut = 0;
                }
                None => uncut = limit + 1,
            }
        }
        let old = buf.len();
        buf.resize(old + BLOCK, 0);
        let n = loop {
            match r.read(&mut buf[old..]) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let at = format!("byte {}", offset + old as u64);
                    return Err(read_error(src, &at, e));
                }
            }
        };
        buf.truncate(old + n);
        eof = n == 0;
    }
    Ok(Stats {
        documents: d.docs,
        text_bytes: offset,
    })
}

#[cfg(test)]
mod tests {
    use super::last_cut;

    #[test]
    fn cuts_only_between_visible_characters() {
        let b = b"ab\ncd\n\nef\n gh";
        assert_eq!(last_cut(b, 0, b.len()), Some(3));
        assert_eq!(last_cut(b, 0, 2), None);
        assert_eq!(last_cut(b, 4, b.len()), None);
        assert_eq!(last_cut(b"\nab", 0, 3), None);
    }
}

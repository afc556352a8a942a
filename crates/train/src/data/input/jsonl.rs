//! JSON Lines (<https://jsonlines.org>): one JSON object per line, the document in the string
//! field named by `--text-field` (default `text`), other fields skipped unread. Blank lines are
//! skipped; an empty text is an empty document (dropped, as in text files).
//!
//! A line is held whole while it is parsed (memory: the longest line), and only the text field
//! is copied out (a string without escapes not even that).

use std::borrow::Cow;
use std::fmt;
use std::io::BufRead;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::{open_stream, read_error, Piece, Read, ReadContext, Source};
use crate::data::error::{DataError, Result};

/// What a line's object holds under the text field.
enum Found<'de> {
    Text(Cow<'de, str>),
    Missing,
    /// The field holds another JSON type (named).
    NotString(&'static str),
}

/// Parses one JSON object, keeping only the value of field `.0`.
struct Object<'f>(&'f str);

impl<'de> DeserializeSeed<'de> for Object<'_> {
    type Value = Found<'de>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Found<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Object<'_> {
    type Value = Found<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found<'de>, A::Error> {
        let mut found = Found::Missing;
        while let Some(is_field) = map.next_key_seed(KeyIs(self.0))? {
            if is_field && matches!(found, Found::Missing) {
                found = map.next_value_seed(Value)?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

/// Deserializes a key to whether it is `.0`.
struct KeyIs<'f>(&'f str);

impl<'de> DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIs<'_> {
    type Value = bool;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a string key")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
        Ok(v == self.0)
    }
}

/// Deserializes the text field's value: a string, or the name of the type it is instead.
struct Value;

impl<'de> DeserializeSeed<'de> for Value {
    type Value = Found<'de>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Found<'de>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Value {
    type Value = Found<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a JSON value")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Found<'de>, E> {
        Ok(Found::Text(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Found<'de>, E> {
        Ok(Found::Text(Cow::Owned(v.to_string())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Found<'de>, E> {
        Ok(Found::Text(Cow::Owned(v)))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Found<'de>, E> {
        Ok(Found::NotString("a boolean"))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Found<'de>, E> {
        Ok(Found::NotString("a number"))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Found<'de>, E> {
        Ok(Found::NotString("a number"))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Found<'de>, E> {
        Ok(Found::NotString("a number"))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Found<'de>, E> {
        Ok(Found::NotString("null"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Found<'de>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Found::NotString("an array"))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found<'de>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Found::NotString("an object"))
    }
}

/// The text field of one line (without its line break), `Ok(None)` for a blank line.
fn text_of<'l>(line: &'l [u8], field: &str) -> std::result::Result<Option<Cow<'l, str>>, String> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let example = format!("{{\"{field}\": \"...\"}}");
    let mut de = serde_json::Deserializer::from_slice(line);
    let found = Object(field).deserialize(&mut de).and_then(|f| {
        de.end()?;
        Ok(f)
    });
    match found {
        Ok(Found::Text(t)) => Ok(Some(t)),
        Ok(Found::Missing) => Err(format!(
            "no \"{field}\" field: pass --text-field with the name of the field that holds the \
             document text"
        )),
        Ok(Found::NotString(kind)) => Err(format!(
            "field \"{field}\" is {kind}, not a string: pass --text-field with the name of the \
             field that holds the document text"
        )),
        Err(e) => {
            // serde_json says "at line 1 column N" of the one line it was given: keep the column.
            let what = e.to_string();
            let what = what.split(" at line ").next().unwrap_or(&what);
            Err(format!(
                "not a JSON object ({what} at column {}): each line must be one JSON object \
                 such as {example}",
                e.column()
            ))
        }
    }
}

/// Reads the documents of a JSON Lines source.
pub fn read(src: &Source, cx: &mut ReadContext<'_>) -> Result<Read> {
    let stream = open_stream(src, cx.bytes_read.clone())?;
    let mut r = std::io::BufReader::with_capacity(1 << 16, stream);
    let mut line = Vec::new();
    let mut out = Read::default();
    for number in 1u64.. {
        line.clear();
        let n = r
            .read_until(b'\n', &mut line)
            .map_err(|e| read_error(src, &format!("line {number}"), e))?;
        if n == 0 {
            break;
        }
        let body = line.strip_suffix(b"\n").unwrap_or(&line);
        let body = body.strip_suffix(b"\r").unwrap_or(body);
        let text = text_of(body, cx.text_field).map_err(|message| DataError::BadInput {
            path: src.path.clone(),
            message: format!("line {number}: {message}"),
        })?;
        if let Some(t) = text.filter(|t| !t.is_empty()) {
            (cx.sink)(Piece {
                text: &t,
                first: true,
                last: true,
            })?;
            out.documents += 1;
            out.text_bytes += t.len() as u64;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::text_of;

    #[test]
    fn picks_the_field_and_names_what_is_wrong() {
        let t = |l: &str| text_of(l.as_bytes(), "text").map(|o| o.map(|c| c.into_owned()));
        assert_eq!(
            t(r#"{"id": 1, "meta": {"text": 5}, "text": "a\"b"}"#).unwrap(),
            Some("a\"b".to_string())
        );
        assert_eq!(t("   ").unwrap(), None);
        assert!(t(r#"{"body": "x"}"#)
            .unwrap_err()
            .starts_with("no \"text\" field"));
        assert!(t(r#"{"text": 5}"#)
            .unwrap_err()
            .starts_with("field \"text\" is a number, not a string"));
        assert!(t(r#"{"text": null}"#).unwrap_err().contains("is null"));
        assert!(t(r#"[1, 2]"#).unwrap_err().starts_with("not a JSON object"));
        assert!(t(r#"{"text": "x"} trailing"#)
            .unwrap_err()
            .starts_with("not a JSON object"));
    }
}

//! Apache Parquet files: the string column named by `--text-field` (default `text`; a nested
//! column by its dotted path, e.g. `meta.body`), row by row, through the `parquet` crate's
//! column reader (no Arrow). Pages are read and decompressed one at a time, so memory is a
//! page or two (writers cut pages at about 1 MiB; pyarrow's default) plus the column's
//! dictionary, whatever the size of the file or its row groups. Compressions read: none,
//! snappy, zstd, lz4.
//!
//! A null in the column is an error naming the row: a document that is not there is more
//! likely a wrong column than an empty document.

use std::fs::File;

use parquet::basic::Type as PhysicalType;
use parquet::column::reader::ColumnReader;
use parquet::data_type::ByteArray;
use parquet::file::reader::{FileReader, SerializedFileReader};

use super::{Piece, Read, ReadContext, Source};
use crate::data::error::{DataError, Result};

/// Rows decoded per call into the column reader.
const ROWS_PER_READ: usize = 256;

fn bad(src: &Source, message: String) -> DataError {
    DataError::BadInput {
        path: src.path.clone(),
        message,
    }
}

/// Reads the documents of a Parquet source.
pub fn read(src: &Source, cx: &mut ReadContext<'_>) -> Result<Read> {
    if src.bytes.is_some() {
        return Err(DataError::InvalidArgument(format!(
            "{}: Parquet is read from files only",
            src.path.display()
        )));
    }
    let file = File::open(&src.path).map_err(|e| DataError::io(&src.path, e))?;
    let reader = SerializedFileReader::new(file).map_err(|e| {
        bad(
            src,
            format!("not a readable Parquet file ({e}): check that it was written completely"),
        )
    })?;
    let field = cx.text_field;
    let (index, max_def) = text_column(src, &reader, field)?;
    let mut out = Read::default();
    let mut row = 0u64;
    let mut done_bytes = 0u64;
    let mut values: Vec<ByteArray> = Vec::with_capacity(ROWS_PER_READ);
    let mut defs: Vec<i16> = Vec::with_capacity(ROWS_PER_READ);
    let perr = |row: u64, e: parquet::errors::ParquetError| {
        bad(
            src,
            format!("row {row}: cannot read column \"{field}\" ({e}): the file is damaged or uses a compression this build does not read (it reads none, snappy, zstd, lz4)"),
        )
    };
    for g in 0..reader.num_row_groups() {
        let group = reader.get_row_group(g).map_err(|e| perr(row, e))?;
        let ColumnReader::ByteArrayColumnReader(mut col) =
            group.get_column_reader(index).map_err(|e| perr(row, e))?
        else {
            unreachable!("a BYTE_ARRAY column has a byte array reader");
        };
        loop {
            values.clear();
            defs.clear();
            let (rows, _, _) = col
                .read_records(ROWS_PER_READ, Some(&mut defs), None, &mut values)
                .map_err(|e| perr(row, e))?;
            if rows == 0 {
                break;
            }
            let mut next = values.iter();
            // A row's value is there when its definition level is the column's maximum.
            let present = |i: usize| max_def == 0 || defs[i] == max_def;
            for i in 0..rows {
                let r = row + i as u64;
                if !present(i) {
                    return Err(bad(
                        src,
                        format!(
                            "row {r}: column \"{field}\" is null: drop or fill the row, or pass \
                             --text-field with the column that holds the document text"
                        ),
                    ));
                }
                let v = next.next().expect("one value per non-null row");
                let text = std::str::from_utf8(v.data()).map_err(|e| {
                    bad(
                        src,
                        format!(
                            "row {r}: column \"{field}\" is not valid UTF-8 at byte {}: store \
                             the text as UTF-8 strings",
                            e.valid_up_to()
                        ),
                    )
                })?;
                if !text.is_empty() {
                    (cx.sink)(Piece {
                        text,
                        first: true,
                        last: true,
                    })?;
                    out.documents += 1;
                    out.text_bytes += text.len() as u64;
                }
            }
            row += rows as u64;
        }
        done_bytes += group.metadata().compressed_size().max(0) as u64;
        cx.bytes_read.set(done_bytes);
    }
    cx.bytes_read.set(src.size);
    Ok(out)
}

/// The column `field` of the file as the text column: its index and its maximum definition
/// level (a row's value is there when its level is this maximum).
fn text_column(
    src: &Source,
    reader: &SerializedFileReader<File>,
    field: &str,
) -> Result<(usize, i16)> {
    let meta = reader.metadata();
    let schema = meta.file_metadata().schema_descr();
    let columns: Vec<String> = (0..schema.num_columns())
        .map(|i| schema.column(i).path().string())
        .collect();
    let Some(index) = columns.iter().position(|c| c == field) else {
        return Err(bad(
            src,
            format!(
                "no column \"{field}\" (columns: {}): pass --text-field with the column that \
                 holds the document text",
                columns.join(", ")
            ),
        ));
    };
    let descr = schema.column(index);
    if descr.physical_type() != PhysicalType::BYTE_ARRAY {
        return Err(bad(
            src,
            format!(
                "column \"{field}\" holds {} values, not strings: pass --text-field with a \
                 string column",
                descr.physical_type()
            ),
        ));
    }
    if descr.max_rep_level() > 0 {
        return Err(bad(
            src,
            format!(
                "column \"{field}\" is a list of strings, not one string per row: pass \
                 --text-field with a string column"
            ),
        ));
    }
    Ok((index, descr.max_def_level()))
}

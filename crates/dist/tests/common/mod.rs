//! Shared test helpers: a tiny Mixtral and its expert-parallel ranks on the threads backend.
#![allow(dead_code)]

pub mod moe;

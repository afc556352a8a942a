//! `ferrotron._native`: the planner's keyword API (`ferrotron_plan::plan_flags`) for Python.
//! Requests and answers cross as JSON text, which `ferrotron/__init__.py` turns into and from
//! Python objects; every planner error becomes a `ValueError` with the CLI's one-line message.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::Value;

fn run(kwargs_json: &str, f: fn(Value) -> ferrotron_plan::Result<Value>) -> PyResult<String> {
    let kw: Value = serde_json::from_str(kwargs_json)
        .map_err(|e| PyValueError::new_err(format!("keywords are not JSON: {e}")))?;
    let out = f(kw).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(out.to_string())
}

/// `ferrotron plan --json` from keywords given as a JSON object; the document as JSON text.
#[pyfunction]
fn plan(py: Python<'_>, kwargs_json: &str) -> PyResult<String> {
    // The planner holds no Python object: other threads may run while it plans.
    py.detach(|| run(kwargs_json, ferrotron_plan::plan_flags::plan_keywords))
}

/// `ferrotron plan search --json` from keywords given as a JSON object.
#[pyfunction]
fn search(py: Python<'_>, kwargs_json: &str) -> PyResult<String> {
    py.detach(|| run(kwargs_json, ferrotron_plan::plan_flags::search_keywords))
}

/// The built-in models, GPUs, networks and setting choices (`ferrotron serve`'s `/api/presets`).
#[pyfunction]
fn presets() -> String {
    ferrotron_plan::api::presets_json().to_string()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(search, m)?)?;
    m.add_function(wrap_pyfunction!(presets, m)?)?;
    Ok(())
}

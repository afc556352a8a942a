//! `--params N --largest-layer M`: a bare count whose largest layer sizes what ZeRO-3 gathers
//! at once (the inputs of DeepSpeed's `estimate_zero3_model_states_mem_needs`).

use ferrotron_plan::api::Settings;
use ferrotron_plan::*;

fn settings(params: &str, largest: Option<&str>, zero: u64, tp: u64) -> Settings {
    Settings {
        params: Some(params.into()),
        largest_layer: largest.map(Into::into),
        dp: Some(8),
        tp: Some(tp),
        zero: Some(zero),
        overhead_gib: Some(0.0),
        fragmentation: Some(0.0),
        ..Settings::default()
    }
}

fn peak(s: &Settings) -> u64 {
    let r = s.resolve(None).unwrap();
    plan(&r.input).unwrap().worst().peak
}

#[test]
fn zero3_gathers_the_largest_layer_twice_and_holds_its_gradients() {
    // bf16: the gathered layer and the prefetched next one (2 × 2 bytes per parameter) and one
    // layer of unsharded gradients (2 bytes) on top of the sharded model states.
    let bare = peak(&settings("7.5e9", None, 3, 1));
    let with = peak(&settings("7.5e9", Some("1e9"), 3, 1));
    assert_eq!(with - bare, 6 * 1_000_000_000);
    // Tensor parallelism splits the layer.
    let tp2 = peak(&settings("7.5e9", Some("1e9"), 3, 2)) - peak(&settings("7.5e9", None, 3, 2));
    assert_eq!(tp2, 6 * 500_000_000);
    // Without ZeRO-3 nothing is gathered.
    assert_eq!(
        peak(&settings("7.5e9", Some("1e9"), 1, 1)),
        peak(&settings("7.5e9", None, 1, 1))
    );
    let r = settings("7.5e9", Some("1e9"), 3, 1).resolve(None).unwrap();
    assert_eq!(
        r.input.model,
        ModelSource::Counted {
            params: 7_500_000_000,
            largest_layer: 1_000_000_000
        }
    );
}

#[test]
fn bad_largest_layers_name_the_field() {
    let err = |s: Settings| match s.resolve(None) {
        Err(e) => e.to_string(),
        Ok(r) => plan(&r.input).unwrap_err().to_string(),
    };
    assert_eq!(
        err(settings("7e9", Some("big"), 3, 1)),
        "largest_layer = big: expected a positive parameter count such as 7.5e9 or 125000000"
    );
    assert_eq!(
        err(settings("7e9", Some("8e9"), 3, 1)),
        "largest_layer = 8000000000: must be a positive count no larger than params = 7000000000"
    );
    let with_model = Settings {
        model: Some("llama-3-8b".into()),
        largest_layer: Some("1e9".into()),
        ..Settings::default()
    };
    assert_eq!(
        err(with_model),
        "largest_layer = 1e9: goes with --params (a model config gives its own layers)"
    );
}

use tch::{Device, Kind, Tensor};

use super::*;
use crate::train::model::{ModelKind, with_tch_rng};

fn model(kind: ModelKind, classes: i64, seed: i64) -> Model {
    with_tch_rng(|| {
        tch::manual_seed(seed);
        Model::new(kind, classes, 4, Device::Cpu).expect("a CPU model builds")
    })
}

/// A model's tensors as a checkpoint holds them: parameters, then buffers.
fn checkpoint_tensors(model: &Model) -> Vec<(String, Tensor)> {
    let mut tensors = model.parameters();
    tensors.extend(model.buffers());
    tensors
}

fn same(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> Result<(), String> {
    let names = |t: &[(String, Tensor)]| t.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    if names(a) != names(b) {
        return Err(format!("names differ: {:?} / {:?}", names(a), names(b)));
    }
    for ((name, x), (_, y)) in a.iter().zip(b) {
        if x.kind() != y.kind() || x.size() != y.size() || !x.equal(y) {
            return Err(format!(
                "`{name}`: {:?} {:?} / {:?} {:?}",
                x.kind(),
                x.size(),
                y.kind(),
                y.size()
            ));
        }
    }
    Ok(())
}

#[test]
fn state_dicts_have_torchvision_names_and_batchnorm_counters() {
    let resnet = state_dict(&checkpoint_tensors(&model(ModelKind::Resnet18, 7, 0)), 12);
    let names: Vec<&str> = resnet.iter().map(|(n, _)| n.as_str()).collect();
    for name in [
        "conv1.weight",
        "bn1.running_mean",
        "bn1.num_batches_tracked",
        "layer1.0.bn1.running_var",
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.num_batches_tracked",
        "fc.weight",
        "fc.bias",
    ] {
        assert!(names.contains(&name), "{name} missing from {names:?}");
    }
    assert!(names.iter().all(|n| !n.contains('|')), "{names:?}");
    // torchvision's ResNet-18 has 20 BatchNorms and 122 state-dict entries.
    let counters: Vec<&(String, Tensor)> = resnet
        .iter()
        .filter(|(n, _)| n.ends_with("num_batches_tracked"))
        .collect();
    assert_eq!((counters.len(), resnet.len()), (20, 122));
    for (_, counter) in counters {
        assert_eq!((counter.kind(), counter.size()), (Kind::Int64, vec![]));
        assert_eq!(counter.int64_value(&[]), 12);
    }
    // tch's file names use `|`; the state dict does not.
    let piped = vec![("a|b.c".to_string(), Tensor::from_slice(&[1.0f32]))];
    assert_eq!(state_dict(&piped, 0)[0].0, "a.b.c");
}

#[test]
fn both_formats_round_trip_names_kinds_shapes_and_values() {
    let mut tensors = state_dict(&checkpoint_tensors(&model(ModelKind::SmallCnn, 5, 1)), 3);
    // A channels-last tensor is written in standard layout; other kinds come back as
    // themselves.
    let nhwc = Tensor::arange(24, (Kind::Float, Device::Cpu))
        .view([1, 2, 3, 4])
        .permute([0, 2, 3, 1])
        .contiguous()
        .permute([0, 3, 1, 2]);
    tensors.push(("nhwc".into(), nhwc.shallow_clone()));
    for kind in [
        Kind::Double,
        Kind::Half,
        Kind::BFloat16,
        Kind::Int,
        Kind::Uint8,
    ] {
        let values = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]);
        tensors.push((format!("kind.{kind:?}"), values.to_kind(kind)));
    }
    let dir = tempfile::tempdir().expect("temp dir");
    for format in WeightsFormat::ALL {
        let path = dir.path().join(format!("w.{format}"));
        write(&path, format, &tensors).expect("write");
        let back = read(&path).expect("read");
        let mut want: Vec<(String, Tensor)> = tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.contiguous()))
            .collect();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        same(&want, &back).unwrap_or_else(|e| panic!("{format}: {e}"));
        let (_, nhwc_back) = back.iter().find(|(n, _)| n == "nhwc").expect("nhwc");
        assert!(nhwc_back.is_contiguous(), "{format}");
        assert_eq!(
            Vec::<f32>::try_from(nhwc_back.flatten(0, -1)).expect("values"),
            Vec::<f32>::try_from(nhwc.flatten(0, -1)).expect("values"),
            "{format}"
        );
        // Nothing partial is left beside it.
        let files: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert!(
            files
                .iter()
                .all(|f| !f.to_string_lossy().contains("partial")),
            "{files:?}"
        );
    }
}

#[test]
fn safetensors_carry_the_pt_format_metadata() {
    let tensors = vec![("w".to_string(), Tensor::from_slice(&[1.0f32, 2.0]))];
    let bytes = safetensors::serialize(&tensors).expect("serialize");
    let (_, metadata) =
        ::safetensors::SafeTensors::read_metadata(&bytes).expect("a safetensors header");
    let format = metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get("format").cloned());
    assert_eq!(format.as_deref(), Some("pt"));
}

#[test]
fn the_pt_archive_has_torch_saves_records_aligned() {
    let tensors = vec![
        ("a".to_string(), Tensor::from_slice(&[1.0f32, 2.0, 3.0])),
        (
            "b".to_string(),
            Tensor::scalar_tensor(7.0, (Kind::Int64, Device::Cpu)),
        ),
    ];
    let bytes = pt::serialize(&tensors).expect("serialize");
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(&bytes)).expect("a zip");
    let names: Vec<String> = zip.file_names().map(String::from).collect();
    for name in [
        "archive/data.pkl",
        "archive/byteorder",
        "archive/data/0",
        "archive/data/1",
        "archive/version",
    ] {
        assert!(names.contains(&name.to_string()), "{name} in {names:?}");
    }
    for index in 0..zip.len() {
        let file = zip.by_index(index).expect("record");
        assert_eq!(file.compression(), zip::CompressionMethod::Stored);
        if file.name().contains("/data/") {
            assert_eq!(file.data_start() % 64, 0, "{}", file.name());
        }
    }
}

/// The pickle `torch.save(OrderedDict(w=torch.ones(2, 3)[:, 1:], n=torch.tensor(5)))`
/// would write, memo and BUILD of `_metadata` included, read back through a storage view.
#[test]
fn the_pickle_reader_runs_torch_saves_opcodes_and_views() {
    let entries = vec![(
        "w".to_string(),
        pickle::TensorRef {
            storage_type: "FloatStorage".into(),
            key: "0".into(),
            offset: 1,
            size: vec![2, 2],
            stride: vec![3, 1],
        },
        6,
    )];
    let mut bytes = pickle::state_dict(&entries);
    // Replace the STOP with a memoised BUILD of `{'_metadata': OrderedDict()}`.
    bytes.pop();
    bytes.extend(b"q\x01}q\x02X\x09\x00\x00\x00_metadatah\x01sb.");
    let value = pickle::load(&bytes).expect("load");
    let pickle::Value::Dict(items) = value else {
        panic!("not a dict: {value:?}")
    };
    let [(pickle::Value::Str(name), pickle::Value::Tensor(reference))] = items.as_slice() else {
        panic!("{items:?}")
    };
    assert_eq!(name, "w");
    let storage: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let tensor = pt::view(&storage, reference).expect("view");
    assert_eq!(
        Vec::<f32>::try_from(tensor.flatten(0, -1)).expect("values"),
        [1.0, 2.0, 4.0, 5.0]
    );
    // A view past its storage, and hostile streams, are errors, not panics.
    let long = pickle::TensorRef {
        offset: 3,
        ..reference.clone()
    };
    assert!(pt::view(&storage, &long).is_err());
    let deep: Vec<u8> = [&[0x80, 2, b')'][..], &[0x85; 100], b"."].concat();
    assert!(
        pickle::load(&deep)
            .expect_err("too deep")
            .contains("nested")
    );
    let mut doubling = vec![0x80, 2, b')', b'q', 0];
    for _ in 0..64 {
        doubling.extend([b'h', 0, b'h', 0, 0x86, b'q', 0]);
    }
    doubling.push(b'.');
    let err = pickle::load(&doubling).expect_err("doubling");
    assert!(err.contains("copies more than"), "{err}");
    let os_system = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00ls\x85R.";
    assert!(
        pickle::load(os_system)
            .expect_err("not a state dict")
            .contains("os.system")
    );
    for truncated in [&bytes[..bytes.len() / 2], &[0x80][..], b""] {
        assert!(pickle::load(truncated).is_err());
    }
}

#[test]
fn unreadable_files_and_unknown_formats_are_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let err = read(&dir.path().join("gone.safetensors")).expect_err("missing");
    assert!(err.to_string().contains("gone.safetensors"), "{err}");
    let junk = dir.path().join("junk.pt");
    std::fs::write(&junk, b"PK\x03\x04 not an archive").expect("write");
    assert!(
        read(&junk)
            .expect_err("junk")
            .to_string()
            .contains("junk.pt")
    );
    let err = "onnx".parse::<WeightsFormat>().expect_err("unknown");
    assert!(err.contains("safetensors, pt"), "{err}");
    let err = write(
        &dir.path().join("no/such/folder/w.pt"),
        WeightsFormat::Pt,
        &[],
    )
    .expect_err("unwritable");
    assert!(err.to_string().contains("no/such/folder/w.pt"), "{err}");
}

#[test]
fn init_copies_everything_and_replaces_only_a_classifier_of_another_size() {
    let dir = tempfile::tempdir().expect("temp dir");
    let source = model(ModelKind::Resnet18, 10, 1);
    let path = dir.path().join("init.safetensors");
    write(
        &path,
        WeightsFormat::Safetensors,
        &state_dict(&checkpoint_tensors(&source), 5),
    )
    .expect("write");
    // The same class count: every tensor is copied.
    let target = model(ModelKind::Resnet18, 10, 2);
    let outcome = load_init(&target, &path).expect("init");
    assert_eq!(outcome.replaced_classifier, None);
    same(&checkpoint_tensors(&source), &checkpoint_tensors(&target)).expect("copied");
    // Another class count: all but the classifier, which is said.
    let other = model(ModelKind::Resnet18, 4, 2);
    let fresh_fc = other
        .parameters()
        .into_iter()
        .find(|(n, _)| n == "fc.weight");
    let fresh_fc = fresh_fc.expect("fc").1.copy();
    let outcome = load_init(&other, &path).expect("init");
    assert_eq!(
        outcome.replaced_classifier,
        Some((vec![10, 512], vec![4, 512]))
    );
    assert!(outcome.describe(&path).contains("classifier was replaced"));
    let params = other.parameters();
    let fc = &params.iter().find(|(n, _)| n == "fc.weight").expect("fc").1;
    assert!(fc.equal(&fresh_fc));
    let conv = |m: &Model| {
        m.parameters()
            .into_iter()
            .find(|(n, _)| n == "conv1.weight")
    };
    assert!(
        conv(&other)
            .expect("conv")
            .1
            .equal(&conv(&source).expect("conv").1)
    );
    // Another model's weights: the first name that does not fit, and the file.
    let err = load_init(&model(ModelKind::Resnet34, 10, 0), &path).expect_err("resnet34");
    let text = err.to_string();
    assert!(
        text.contains("init.safetensors") && text.contains("has no `layer1.2."),
        "{text}"
    );
    let err = load_init(&model(ModelKind::SmallCnn, 10, 0), &path).expect_err("small cnn");
    assert!(err.to_string().contains("small_cnn has not"), "{err}");
}

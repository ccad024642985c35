//! The README's first command, `cargo run -p gpu-sim --bin demo`: the
//! binary runs end to end and its report shows what each step is for.

#[test]
fn demo_runs_end_to_end() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_demo"))
        .output()
        .unwrap();
    let (status, stdout, stderr) = (
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.contains("doslab.io/gpu-memory      188416    188416"),
        "{stdout}"
    );
    assert!(
        stdout.contains("CUDA_DEVICE_MEMORY_LIMIT_0=40960m"),
        "{stdout}"
    );
    assert!(stdout.contains("unknown device ID"), "{stdout}");
    // Pod matching: the scheduler's GPU is honoured, the too-big pod is
    // refused with an Event, every served pod is marked assigned.
    let pinned = stdout.split("pod pinned").nth(1).unwrap_or_default();
    assert!(
        pinned.lines().nth(1).unwrap_or_default().contains(
            "CUDA_DEVICE_MEMORY_LIMIT_0=8000m CUDA_DEVICE_SM_LIMIT=20 DOSLAB_IO_GPU_CORE=20 \
             DOSLAB_IO_GPU_MEMORY=8000 NVIDIA_VISIBLE_DEVICES=GPU-0a9f6c24"
        ),
        "{stdout}"
    );
    assert_eq!(stdout.matches("gpu-assigned=true").count(), 5, "{stdout}");
    assert!(stdout.contains("too-big GpuAllocateFailed"), "{stdout}");
    assert!(
        stdout.contains("streams ended: yes; plugin sockets left: 0"),
        "{stdout}"
    );
    // Placement: by node totals alone the 30 GiB pod lands on the node of
    // two 24 GiB GPUs and its kubelet refuses it; through the extender
    // every pod that fits a GPU is admitted, and the one no GPU holds is
    // refused by filter with the reason.
    let (alone, with) = stdout
        .split_once("With the extender")
        .unwrap_or_else(|| panic!("no run with the extender: {stdout}"));
    let alone = alone
        .split_once("Without the extender")
        .map(|(_, a)| a)
        .unwrap_or_else(|| panic!("no run without the extender: {stdout}"));
    assert!(
        alone.contains("train-a   -> node-a: REFUSED at admission")
            && alone.contains("2 admission failures"),
        "{stdout}"
    );
    assert!(with.contains("0 admission failures"), "{stdout}");
    assert_eq!(
        with.matches(" % of its compute\n").count(),
        4 + 7,
        "{stdout}"
    );
    assert!(
        with.contains("no GPU has 92160 MiB free (largest 40960 MiB"),
        "{stdout}"
    );
}

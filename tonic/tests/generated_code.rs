//! The example service's client and server code
//! (`examples/common/verbio.echo.Echo.rs`) is what tonic-build's manual
//! builder (no `.proto` file, no `protoc`) makes from the definition
//! below today. After changing the definition, regenerate the file with
//! `VERBIO_TONIC_REGENERATE=1 cargo test -p verbio-tonic --test generated_code`.

use std::path::{Path, PathBuf};

use tonic_build::manual::{Builder, Method, Service};

/// The service: a unary and a server-streaming method, messages encoded
/// with prost (the message types are in `examples/common/mod.rs`).
fn echo_service() -> Service {
    let method = |name: &str, route: &str, input: &str, output: &str| {
        Method::builder()
            .name(name)
            .route_name(route)
            .input_type(input)
            .output_type(output)
            .codec_path("tonic_prost::ProstCodec")
    };
    Service::builder()
        .name("Echo")
        .package("verbio.echo")
        .comment("Echoes a payload, and streams generated chunks.")
        .method(
            method(
                "unary_echo",
                "UnaryEcho",
                "super::EchoRequest",
                "super::EchoReply",
            )
            .comment("Answers the request's payload.")
            .build(),
        )
        .method(
            method(
                "stream_chunks",
                "StreamChunks",
                "super::StreamRequest",
                "super::Chunk",
            )
            .comment("Streams `chunks` chunks of `chunk_len` bytes made from `seed`.")
            .server_streaming()
            .build(),
        )
        .build()
}

fn checked_in() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/common/verbio.echo.Echo.rs")
}

#[test]
fn generated_service_code_is_up_to_date() {
    let dir = std::env::temp_dir().join(format!("verbio-tonic-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating a temporary directory");
    Builder::new().out_dir(&dir).compile(&[echo_service()]);
    let fresh = std::fs::read_to_string(dir.join("verbio.echo.Echo.rs")).expect("generated file");
    let _ = std::fs::remove_dir_all(&dir);
    if std::env::var_os("VERBIO_TONIC_REGENERATE").is_some() {
        std::fs::write(checked_in(), &fresh).expect("writing the checked-in file");
        return;
    }
    let kept = std::fs::read_to_string(checked_in()).expect("the checked-in generated file");
    assert!(
        kept == fresh,
        "{} is stale: regenerate it with VERBIO_TONIC_REGENERATE=1 cargo test -p verbio-tonic --test generated_code",
        checked_in().display()
    );
}

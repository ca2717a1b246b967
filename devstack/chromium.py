"""The headless Chromium that the browser tests and the engine benchmark drive (WebGL2 on SwiftShader)."""

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = (
    "--enable-unsafe-swiftshader",
    "--use-angle=swiftshader",
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    # WebGPU (SwiftShader's adapter here) for the tests of TF.js's webgpu backend; pages pick WebGL first.
    "--enable-unsafe-webgpu",
)

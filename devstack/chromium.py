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
    # SwiftShader is the GPU here, emulated on the CPU: on a loaded 2-core machine one batch of shaders can
    # outlast the GPU watchdog, which then kills the GPU process that every page shares, and every WebGL
    # context with it (the pipeline e2e's two browsers stopped at the same second, mid-unit).
    "--disable-gpu-watchdog",
    # WebGPU (SwiftShader's adapter here) for the tests of TF.js's webgpu backend; pages pick WebGL first.
    "--enable-unsafe-webgpu",
)

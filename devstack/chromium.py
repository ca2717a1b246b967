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
)

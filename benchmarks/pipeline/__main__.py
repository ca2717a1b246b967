from benchmarks.pipeline.run import main

main()

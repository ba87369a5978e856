"""ckpt under the frameworks people train with: Lightning (:mod:`.lightning`), the Hugging
Face Trainer (:mod:`.hf`) and Accelerate (:mod:`.accelerate`). Each module imports its
framework when imported itself; importing this package imports none of them."""

"""The Annotated Transformer as a fairseq plugin (user-dir module ``fairseq_plugin``)."""

from setuptools import find_packages, setup

setup(
    name="fairseq-annotated-transformer",
    version="0.1.0",
    description="The Annotated Transformer as a fairseq user-dir plugin: model, cached "
                "attention for beam search, label smoothing and the Noam schedule",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    classifiers=[
        "License :: OSI Approved :: MIT License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    python_requires=">=3.10",
    packages=find_packages(include=["fairseq_plugin", "fairseq_plugin.*"]),
    install_requires=[
        "torch>=2.1",  # tested: 2.1.2 and 2.13.0 (docs/install.md)
        # both provide the ``fairseq`` package; PyPI's 0.12.2 fails to import on Python >= 3.11.
        # fairseq 0.12.2 needs pip < 24.1 to install (omegaconf 2.0.6's metadata; docs/install.md).
        'fairseq==0.12.2; python_version < "3.11"',
        'fairseq-fixed==0.12.3.1; python_version >= "3.11"',
        # fairseq 0.12.2 (2022) and torch < 2.3 were built for NumPy 1
        'numpy<2; python_version < "3.11"',
        "sacremoses",
        "subword-nmt",
        "sacrebleu>=2",
    ],
    extras_require={"test": ["pytest", "pytest-xdist", "matplotlib", "ctranslate2", "jupytext",
                             "nbclient", "ipykernel"],
                    "viz": ["matplotlib"],
                    "export": ["ctranslate2"],
                    # examples/walkthrough in Jupyter (make walkthrough)
                    "walkthrough": ["matplotlib", "altair>=5", "jupytext", "nbclient",
                                    "ipykernel", "jupyterlab"],
                    # the walkthrough as a web page (make page: scripts/build_page.py; mkdocs 2
                    # is another program), and its browser test (Playwright drives Chromium)
                    "page": ["matplotlib", "altair>=5", "jupytext", "nbclient", "ipykernel",
                             "vl-convert-python>=1.1", "mkdocs>=1.6,<2", "mkdocs-material>=9.5",
                             "mkdocs-jupyter>=0.25", "playwright>=1.40"]},
    entry_points={
        "console_scripts": [
            "annotated-prepare=fairseq_plugin.cli.prepare:main",
            "annotated-evaluate-bleu=fairseq_plugin.cli.evaluate:main",
            "annotated-attention-heatmaps=fairseq_plugin.cli.heatmaps:main",
            "annotated-average-checkpoints=fairseq_plugin.cli.average_checkpoints:main",
            "annotated-reverse-data=fairseq_plugin.cli.reverse_task:main",
            "annotated-copy-data=fairseq_plugin.cli.reverse_task:copy_main",
            "annotated-export-fairseq=fairseq_plugin.export:main",
            "annotated-benchmark=fairseq_plugin.benchmark.main:main",
            "annotated-benchmark-learning=fairseq_plugin.cli.learning:main",
            "annotated-benchmark-deployment=fairseq_plugin.cli.deployment:main",
        ],
    },
)

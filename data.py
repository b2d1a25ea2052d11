"""Build a corpus: `python data.py --demo --out corpus/demo`, `python data.py --data FILES --out CORPUS`,
`python data.py --verify CORPUS` (docs/data.md). The code: tinyllm/data/build.py."""

from tinyllm.data.build import command

if __name__ == "__main__":
    command()

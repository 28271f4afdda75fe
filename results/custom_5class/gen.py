"""5-topic generated reviews (the issue 48 shape): 600 train, 150 dev."""
import csv, random, sys, re, collections
seed = int(sys.argv[1]); out = sys.argv[2]
pub = [r['text'] for r in csv.DictReader(open('/work/shared/data/calib/imdb/unsup_sample5000.tsv'), delimiter='\t', quoting=csv.QUOTE_NONE)]
words = collections.Counter(w for t in pub for w in re.findall(r"[a-z]+", t.lower()))
common = [w for w, c in words.most_common(3000)]
rng = random.Random(seed)
filler = common[:300]
topic_pool = [w for w in common[300:2000] if len(w) > 3]
keys = rng.sample(topic_pool, 20)
classes = ['sports', 'food', 'travel', 'music', 'science']
def record():
    y = rng.randrange(5)
    n = rng.randint(10, 30)
    text = [rng.choice(filler) for _ in range(n)]
    for _ in range(rng.randint(1, 2)):
        text.insert(rng.randrange(len(text) + 1), rng.choice(keys[4 * y: 4 * y + 4]))
    if rng.random() < 0.05:
        y = rng.randrange(5)
    return ' '.join(text), classes[y]
for name, n in (('train', 600), ('dev', 150)):
    with open(f'{out}/{name}.tsv', 'w') as f:
        f.write('text\ttopic\n')
        for _ in range(n):
            t, y = record(); f.write(f'{t}\t{y}\n')
print(keys)

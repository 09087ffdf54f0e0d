#!/usr/bin/env python3
"""Fails if a module imports, directly or through others, a module that imports it, inside any crate
(`crate::` and `super::` paths of each src file, test modules left out). Usage: import-cycles.py CRATE_DIR..."""
import os, re, sys
def modname(crate_src, path):
    rel = os.path.relpath(path, crate_src)[:-3]
    parts = rel.split('/')
    if parts[-1] in ('mod','lib'): parts = parts[:-1]
    return '::'.join(parts) or 'crate'
found = False
for crate in sys.argv[1:]:
    src = os.path.join(crate, 'src')
    files = [os.path.join(d,f) for d,_,fs in os.walk(src) for f in fs if f.endswith('.rs') and '/bin/' not in os.path.join(d,f)]
    mods = {modname(src,f): f for f in files}
    # names the crate root re-exports (`pub use module::{A, B}`), so `crate::A` is module's
    reexported = {}
    root_text = open(os.path.join(src, 'lib.rs')).read() if os.path.exists(os.path.join(src, 'lib.rs')) else ''
    for mm in re.finditer(r'pub use ([a-z_][a-z0-9_:]*)::\{([^}]*)\};|pub use ([a-z_][a-z0-9_:]*)::([A-Za-z_][A-Za-z0-9_]*);', root_text):
        module = mm.group(1) or mm.group(3)
        names = mm.group(2) or mm.group(4)
        for n in names.split(','):
            n = n.strip().split(' as ')[-1].strip()
            if n and module in mods:
                reexported[n] = module
    edges = {}
    for m,f in mods.items():
        text = open(f).read()
        # strip cfg(test) modules crudely
        text = re.split(r'#\[cfg\(test\)\]\s*mod tests', text)[0]
        # comments (doc links included) are not imports
        text = re.sub(r'//[^\n]*', '', text)
        deps=set()
        for mm in re.finditer(r'crate::([A-Z][A-Za-z0-9_]*)', text):
            if mm.group(1) in reexported:
                deps.add(reexported[mm.group(1)])
        for mm in re.finditer(r'crate::([a-z_][a-z0-9_]*(?:::[a-z_][a-z0-9_]*)*)', text):
            path = mm.group(1).split('::')
            # longest module prefix
            for i in range(len(path),0,-1):
                cand='::'.join(path[:i])
                if cand in mods: deps.add(cand); break
        for mm in re.finditer(r'\bsuper::([a-z_][a-z0-9_]*)', text):
            parent = '::'.join(m.split('::')[:-1]) if '::' in m else 'crate'
            cand = (parent+'::'+mm.group(1)) if parent!='crate' else mm.group(1)
            if cand in mods: deps.add(cand)
            else: deps.add(parent if parent!='crate' else 'crate')
        deps.discard(m)
        edges[m]=deps
    # strongly connected components of more than one module are cycles
    index={}; low={}; st=[]; on=set(); sccs=[]; c=[0]
    sys.setrecursionlimit(10000)
    def sc(v):
        index[v]=low[v]=c[0]; c[0]+=1; st.append(v); on.add(v)
        for w in edges.get(v,()):
            if w not in edges: continue
            if w not in index: sc(w); low[v]=min(low[v],low[w])
            elif w in on: low[v]=min(low[v],index[w])
        if low[v]==index[v]:
            comp=[]
            while True:
                w=st.pop(); on.discard(w); comp.append(w)
                if w==v: break
            if len(comp)>1: sccs.append(comp)
    for v in edges:
        if v not in index: sc(v)
    print(crate, 'modules:', len(mods), 'cycles:', sccs if sccs else 'none')
    found = found or bool(sccs)
sys.exit(1 if found else 0)

package operator

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"path"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"

	"pilab.hu/pivirt-agent/cmd/internal/operator/certz/v1alpha1"
	"pilab.hu/pivirt-agent/identity"
)

// Policy says which namespaces may ask for which certificates. The
// operator signs with a pitrust-admin credential: without a policy, any
// user allowed to create a ManagedCertificate anywhere could get any name
// — the CA server's own admin CN, an agent's identity. So with no policy
// file only the operator's own namespace may ask (for anything), and a
// file (--policy) names what each other namespace may have.
type Policy struct {
	Rules []PolicyRule `yaml:"rules"`

	// file names the policy in messages; own is the operator's namespace.
	file, own string
}

// PolicyRule grants the namespaces it names certificates whose every name
// it allows. Patterns are shell globs (* matches any characters, dots
// included); an empty list allows nothing of that kind, except types,
// which default to both.
type PolicyRule struct {
	Namespaces  []string `yaml:"namespaces"`
	CommonNames []string `yaml:"commonNames"`
	DNSNames    []string `yaml:"dnsNames"`
	// IPAddresses are CIDR prefixes (10.0.0.0/8, 2001:db8::/32).
	IPAddresses []string `yaml:"ipAddresses"`
	// Types: mtls-server, mtls-client (default both).
	Types []string `yaml:"types"`
	// Clusters are the agents' cluster names a certificate may be bound to
	// (spec.cluster): agent identities, none unless named.
	Clusters []string `yaml:"clusters"`
	// CAServers are CA server URLs a resource may name in issuerRef.url
	// besides the operator's --ca-server ("*": any).
	CAServers []string `yaml:"caServers"`
	// Offline allows issuerRef.secretName: an X1 intermediate in a Secret
	// of the namespace.
	Offline bool `yaml:"offline"`

	nets []*net.IPNet
}

// LoadPolicy reads a policy file ("" → the default: own namespace only).
func LoadPolicy(file, ownNamespace string) (*Policy, error) {
	p := &Policy{file: file, own: ownNamespace}
	if file == "" {
		return p, nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("--policy: %w", err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(p); err != nil {
		return nil, fmt.Errorf("--policy %s: %w (the keys: rules[].namespaces, commonNames, dnsNames, ipAddresses, types, clusters, caServers, offline)", file, err)
	}
	if len(p.Rules) == 0 {
		return nil, fmt.Errorf("--policy %s: no rules: a policy that allows nothing is a mistake (leave --policy out to allow the operator's own namespace only)", file)
	}
	for i := range p.Rules {
		r := &p.Rules[i]
		where := fmt.Sprintf("--policy %s: rules[%d]", file, i)
		if len(r.Namespaces) == 0 {
			return nil, fmt.Errorf("%s: namespaces is required (\"*\" for all)", where)
		}
		for _, list := range [][]string{r.Namespaces, r.CommonNames, r.DNSNames, r.Clusters, r.CAServers} {
			for _, pat := range list {
				if _, err := path.Match(pat, ""); err != nil {
					return nil, fmt.Errorf("%s: pattern %q: %v", where, pat, err)
				}
			}
		}
		for _, c := range r.IPAddresses {
			_, n, err := net.ParseCIDR(c)
			if err != nil {
				return nil, fmt.Errorf("%s: ipAddresses %q: want a CIDR prefix such as 10.0.0.0/8", where, c)
			}
			r.nets = append(r.nets, n)
		}
		for _, t := range r.Types {
			if t != v1alpha1.TypeMTLSServer && t != v1alpha1.TypeMTLSClient {
				return nil, fmt.Errorf("%s: types %q: want mtls-server or mtls-client", where, t)
			}
		}
	}
	return p, nil
}

// Allows reports whether a resource of namespace may have the certificate
// w from the issuer ref (defaultURL: the operator's --ca-server).
func (p *Policy) Allows(namespace string, w wanted, ref v1alpha1.IssuerRef, defaultURL string) error {
	if len(p.Rules) == 0 {
		if namespace == p.own {
			return nil
		}
		return fmt.Errorf("namespace %s may not ask for certificates: without an issuance policy (pitrust operator --policy FILE) only the operator's namespace %s may", namespace, p.own)
	}
	var first error
	for i := range p.Rules {
		r := &p.Rules[i]
		if !globAny(r.Namespaces, namespace) {
			continue
		}
		err := r.allows(w, ref, defaultURL)
		if err == nil {
			return nil
		}
		if first == nil {
			first = fmt.Errorf("rules[%d] of %s: %w", i, p.file, err)
		}
	}
	if first == nil {
		return fmt.Errorf("no rule of the issuance policy %s names namespace %s", p.file, namespace)
	}
	return fmt.Errorf("namespace %s may not have this certificate: %w", namespace, first)
}

func (r *PolicyRule) allows(w wanted, ref v1alpha1.IssuerRef, defaultURL string) error {
	if len(r.Types) > 0 && !slices.Contains(r.Types, string(w.kind)) {
		return fmt.Errorf("type %s is not among %v", w.kind, r.Types)
	}
	if !globAny(r.CommonNames, w.name) {
		return fmt.Errorf("commonName %s matches none of %v", w.name, r.CommonNames)
	}
	for _, d := range w.dns {
		if d == w.name && slices.Contains(w.usages, identity.UsageServer) {
			continue // the CN served as its DNS name: allowed with the CN
		}
		if !globAny(r.DNSNames, strings.ToLower(d)) && !globAny(r.DNSNames, d) {
			return fmt.Errorf("dnsName %s matches none of %v", d, r.DNSNames)
		}
	}
	for _, ip := range w.ips {
		if !slices.ContainsFunc(r.nets, func(n *net.IPNet) bool { return n.Contains(ip) }) {
			return fmt.Errorf("ipAddress %s is in none of %v", ip, r.IPAddresses)
		}
	}
	if w.cluster != "" && !globAny(r.Clusters, w.cluster) {
		return fmt.Errorf("cluster %s matches none of %v (an agent identity)", w.cluster, r.Clusters)
	}
	switch {
	case ref.SecretName != "" && !r.Offline:
		return errors.New("an offline issuer (issuerRef.secretName) is not allowed (offline: true)")
	case ref.URL != "" && ref.URL != defaultURL && !globAny(r.CAServers, ref.URL):
		return fmt.Errorf("the CA server %s is not the operator's and matches none of caServers %v", ref.URL, r.CAServers)
	}
	return nil
}

func globAny(patterns []string, s string) bool {
	for _, p := range patterns {
		if ok, _ := path.Match(p, s); ok {
			return true
		}
	}
	return false
}

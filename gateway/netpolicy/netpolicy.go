// Package netpolicy is the NetworkPolicy of the service mesh (the
// reference example is testdata/spec-networkpolicy.yaml): which service
// identities may connect to which, on which ports. A service identity is a DNS (or URI) subject alternative
// name of the peer's PiTrust certificate ("agent.pivirt.internal"). The
// agent checks the policies in the TLS handshake: of callers on its
// internal and Raft ports, and of the backends it calls.
package netpolicy

import (
	"bytes"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"
)

// The policy documents' header.
const (
	APIVersion = "pivirt.pilab.hu/v1"
	Kind       = "NetworkPolicy"
)

// ErrInvalid wraps every problem of a policy file.
var ErrInvalid = errors.New("invalid network policy")

// Policy is one NetworkPolicy document.
type Policy struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   struct {
		Name string `yaml:"name"`
	} `yaml:"metadata"`
	Spec struct {
		Ingress []Rule `yaml:"ingress"`
	} `yaml:"spec"`
}

// Rule allows connections from any of From to any of To (none: any
// service) on any of Ports (none: any port).
type Rule struct {
	From  []Peer `yaml:"from"`
	To    []Peer `yaml:"to"`
	Ports []Port `yaml:"ports"`
}

// Peer names a service identity: a DNS name, "*.suffix" for the names
// under suffix, or "*" for every identity.
type Peer struct {
	Service string `yaml:"service"`
}

// Port is a TCP port.
type Port struct {
	Protocol string `yaml:"protocol"`
	Port     int    `yaml:"port"`
}

// Set is the policies of a file: a connection is allowed when a rule of
// any of them allows it.
type Set struct {
	Policies []Policy
}

var serviceName = regexp.MustCompile(`^(\*|(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*)$`)

// Parse reads one or more NetworkPolicy documents (separated by "---") and
// checks them; every problem is reported with its place
// (allow-agent-to-pivirtd: spec.ingress[0].ports[0].port).
func Parse(r io.Reader) (*Set, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, err
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var set Set
	var errs []error
	names := map[string]bool{}
	for i := 0; ; i++ {
		var p Policy
		if err := dec.Decode(&p); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return nil, fmt.Errorf("%w: document %d: %v", ErrInvalid, i+1, err)
		}
		at := fmt.Sprintf("document %d", i+1)
		if p.Metadata.Name != "" {
			at = p.Metadata.Name
		}
		add := func(path, format string, args ...any) {
			errs = append(errs, fmt.Errorf("%w: %s: %s: %s", ErrInvalid, at, path, fmt.Sprintf(format, args...)))
		}
		switch {
		case p.Metadata.Name == "":
			add("metadata.name", "required")
		case names[p.Metadata.Name]:
			add("metadata.name", "%q is used by another policy", p.Metadata.Name)
		}
		names[p.Metadata.Name] = true
		if p.APIVersion != APIVersion {
			add("apiVersion", "%q, want %q", p.APIVersion, APIVersion)
		}
		if p.Kind != Kind {
			add("kind", "%q, want %q", p.Kind, Kind)
		}
		if len(p.Spec.Ingress) == 0 {
			add("spec.ingress", "no rules")
		}
		for j, r := range p.Spec.Ingress {
			rat := fmt.Sprintf("spec.ingress[%d]", j)
			if len(r.From) == 0 {
				add(rat+".from", "required: the services allowed to connect (\"*\" for any)")
			}
			for k, peer := range r.From {
				if !serviceName.MatchString(peer.Service) {
					add(fmt.Sprintf("%s.from[%d].service", rat, k), "%q is not a service name such as agent.pivirt.internal, *.pivirt.internal or *", peer.Service)
				}
			}
			for k, peer := range r.To {
				if !serviceName.MatchString(peer.Service) {
					add(fmt.Sprintf("%s.to[%d].service", rat, k), "%q is not a service name such as pivirtd.pivirt.internal, *.pivirt.internal or *", peer.Service)
				}
			}
			for k := range r.Ports {
				port := &r.Ports[k]
				pat := fmt.Sprintf("%s.ports[%d]", rat, k)
				if port.Protocol == "" {
					port.Protocol = "TCP"
				}
				if port.Protocol != "TCP" {
					add(pat+".protocol", "%q: only TCP", port.Protocol)
				}
				if port.Port < 1 || port.Port > 65535 {
					add(pat+".port", "%d: want 1 to 65535", port.Port)
				}
			}
		}
		set.Policies = append(set.Policies, p)
	}
	if len(set.Policies) == 0 && len(errs) == 0 {
		errs = append(errs, fmt.Errorf("%w: the file holds no policy", ErrInvalid))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return &set, nil
}

// Allows reports whether a connection from a peer with the identities
// from to one with the identities to on port is allowed, and by which
// policy.
func (s *Set) Allows(from, to []string, port int) (bool, string) {
	for _, p := range s.Policies {
		for _, r := range p.Spec.Ingress {
			if matchAny(r.From, from) && (len(r.To) == 0 || matchAny(r.To, to)) &&
				(len(r.Ports) == 0 || slices.ContainsFunc(r.Ports, func(pp Port) bool { return pp.Port == port })) {
				return true, p.Metadata.Name
			}
		}
	}
	return false, ""
}

func matchAny(peers []Peer, ids []string) bool {
	for _, p := range peers {
		for _, id := range ids {
			if match(p.Service, id) {
				return true
			}
		}
	}
	return false
}

func match(pattern, id string) bool {
	switch {
	case pattern == "*":
		return true
	case strings.HasPrefix(pattern, "*."):
		return strings.HasSuffix(strings.ToLower(id), strings.ToLower(pattern[1:]))
	}
	return strings.EqualFold(pattern, id)
}

// Identities are a certificate's service identities: its DNS and URI
// subject alternative names.
func Identities(cert *x509.Certificate) []string {
	if cert == nil {
		return nil
	}
	out := slices.Clone(cert.DNSNames)
	for _, u := range cert.URIs {
		out = append(out, u.String())
	}
	return out
}

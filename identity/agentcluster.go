package identity

import (
	"crypto/x509"
	"fmt"
	"net/url"
	"strings"
)

// ClusterURIPrefix starts the URI subject alternative name that binds an
// agent's certificate to its cluster (urn:pivirt:cluster:<cluster.name>,
// pitrust issue-mtls-client --cluster): agents whose certificates name a
// cluster accept, on their internal and Raft ports and in node proofs,
// only agents of that cluster, so that clusters sharing one CA cannot act
// in each other.
const ClusterURIPrefix = "urn:pivirt:cluster:"

// ClusterURI is the URI that names cluster in an agent's certificate.
func ClusterURI(cluster string) *url.URL {
	return &url.URL{Scheme: "urn", Opaque: "pivirt:cluster:" + cluster}
}

// AgentCluster returns the cluster an agent's certificate names ("" when
// it names none); more than one is an error.
func AgentCluster(c *x509.Certificate) (string, error) {
	found := ""
	for _, u := range c.URIs {
		name, ok := strings.CutPrefix(u.String(), ClusterURIPrefix)
		if !ok {
			continue
		}
		if name == "" || found != "" && found != name {
			return "", fmt.Errorf("%q names clusters %q and %q: an agent certificate names one", c.Subject.CommonName, found, name)
		}
		found = name
	}
	return found, nil
}

// CheckAgentCluster checks that an agent's certificate belongs to
// cluster: it must not name another one, and, when required (this
// cluster's agents carry the name), it must name this one.
func CheckAgentCluster(c *x509.Certificate, cluster string, required bool) error {
	name, err := AgentCluster(c)
	switch {
	case err != nil:
		return err
	case name != "" && name != cluster:
		return fmt.Errorf("%q is an agent certificate of cluster %q, not of this cluster (%q)", c.Subject.CommonName, name, cluster)
	case name == "" && required:
		return fmt.Errorf("%q names no cluster, and this cluster's agents carry %s%s: reissue it with pitrust issue-mtls-client --cluster %s", c.Subject.CommonName, ClusterURIPrefix, cluster, cluster)
	}
	return nil
}

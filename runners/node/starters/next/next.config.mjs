/** @type {import('next').NextConfig} */
const nextConfig = {
  // A static export in out/: the broker serves it at /preview/<id>/.
  output: 'export',
  // basePath cannot be relative; a relative assetPrefix makes /_next/ assets
  // load from under whatever prefix the page is served at (pages one level
  // deep, e.g. /about, keep working; deeper pages do not).
  assetPrefix: './',
  images: { unoptimized: true },
  // No network in the sandbox: no ESLint install prompt, no telemetry.
  eslint: { ignoreDuringBuilds: true },
}

export default nextConfig
